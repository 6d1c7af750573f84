"""`--ssl-ciphers`: the TLS 1.2 cipher suites the server accepts, through real handshakes.

vLLM hands the string to uvicorn, which calls SSLContext.set_ciphers with it; OpenSSL's
cipher lists govern TLS 1.2 and below, while TLS 1.3 keeps its own suites (vLLM's help
says so). The server here is the context build_ssl_context makes from the flags, on a
stub app; the clients are Python's ssl with their versions and suites pinned. A cipher
string OpenSSL refuses stops the start (tests/server/test_serve_command.py).
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
from pathlib import Path

import pytest
from aiohttp import web

from aioserve.config.frontend import frontend_config
from aioserve.server.http_runner import make_runner
from aioserve.server.serve import build_ssl_context
from aioserve.server.tls_refresh import TLSRefresher
from tests.server.test_tls_refresh import _der, _install, _self_signed, _wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

ALLOWED = "ECDHE-ECDSA-AES256-GCM-SHA384"  # the certificates are P-256 (ECDSA) ones
OTHER = "ECDHE-ECDSA-AES128-GCM-SHA256"
REFUSED = (ssl.SSLError, ConnectionResetError)
"""How a refused handshake reaches the client: an alert, or the connection dropped."""


async def handshake(port: int, tls12_cipher: str | None = None) -> tuple[str, int]:
    """(suite, protocol minor version) a new connection agrees on: TLS 1.2 offering only
    `tls12_cipher`, or TLS 1.3 when None."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    if tls12_cipher is None:
        client.minimum_version = ssl.TLSVersion.TLSv1_3
    else:
        client.maximum_version = ssl.TLSVersion.TLSv1_2
        client.set_ciphers(tls12_cipher)
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        name, version, _ = writer.get_extra_info("ssl_object").cipher()
        return name, int(version.removeprefix("TLSv1."))
    finally:
        writer.close()
        await writer.wait_closed()


async def serve(key: Path, cert: Path, **flags) -> tuple[ssl.SSLContext, web.AppRunner, int]:
    options = frontend_config(ssl_certfile=str(cert), ssl_keyfile=str(key), **flags)
    context = build_ssl_context(options)
    runner = make_runner(web.Application(), options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    return context, runner, runner.addresses[0][1]


def test_tls12_takes_only_the_listed_suites_and_tls13_is_untouched(tmp_path):
    key, cert = _self_signed(tmp_path, "server")

    async def scenario() -> None:
        _, runner, port = await serve(key, cert, ssl_ciphers=ALLOWED)
        try:
            assert await handshake(port, ALLOWED) == (ALLOWED, 2)
            with pytest.raises(REFUSED):
                await handshake(port, OTHER)
            suite, minor = await handshake(port)
            assert minor == 3 and suite.startswith("TLS_")
        finally:
            await runner.cleanup()
        # The control: without the flag the other suite is taken.
        _, runner, port = await serve(key, cert)
        try:
            assert await handshake(port, OTHER) == (OTHER, 2)
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_refreshed_certificate_keeps_the_cipher_list(tmp_path):
    first, second = _self_signed(tmp_path, "first"), _self_signed(tmp_path, "second")
    live = (tmp_path / "live.key", tmp_path / "live.pem")
    _install(first, live)

    async def scenario() -> None:
        context, runner, port = await serve(*live, ssl_ciphers=ALLOWED, enable_ssl_refresh=True)
        refresher = TLSRefresher(context, str(live[1]), str(live[0]), poll_seconds=0.02)
        refresher.start()
        try:
            _install(second, live)
            assert await _wait_for(port, _der(second[1])) == _der(second[1])
            assert await handshake(port, ALLOWED) == (ALLOWED, 2)
            with pytest.raises(REFUSED):
                await handshake(port, OTHER)
        finally:
            await refresher.stop()
            await runner.cleanup()

    asyncio.run(scenario())
