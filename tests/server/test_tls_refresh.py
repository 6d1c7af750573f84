"""`--enable-ssl-refresh`: a certificate rotated on disk reaches new TLS connections of a
running server, and a half-written or broken one never takes the server's chain away."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from aiohttp import web

from aioserve.server.tls_refresh import TLSRefresher

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")

POLL = 0.02


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={name}"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return key, cert


def _der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


async def _served_certificate(port: int) -> bytes:
    """The DER certificate a new connection to the server is shown."""
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname, client.verify_mode = False, ssl.CERT_NONE
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        await writer.wait_closed()


async def _wait_for(port: int, expected: bytes, seconds: float = 5.0) -> bytes:
    served = b""
    for _ in range(int(seconds / POLL)):
        served = await _served_certificate(port)
        if served == expected:
            break
        await asyncio.sleep(POLL)
    return served


async def _tls_server(live: tuple[Path, Path]) -> tuple[ssl.SSLContext, web.AppRunner, int]:
    """A server on a free port whose TLS context holds the `live` (key, certificate) pair."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(live[1], live[0])
    runner = web.AppRunner(web.Application())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
    return context, runner, runner.addresses[0][1]


def _install(source: tuple[Path, Path], target: tuple[Path, Path]) -> None:
    for src, dst in zip(source, target, strict=True):
        shutil.copyfile(src, dst)


def test_a_rotated_certificate_reaches_new_connections(tmp_path, caplog):
    first, second = _self_signed(tmp_path, "first"), _self_signed(tmp_path, "second")
    live = (tmp_path / "live.key", tmp_path / "live.pem")
    _install(first, live)

    async def scenario() -> None:
        context, runner, port = await _tls_server(live)
        refresher = TLSRefresher(context, str(live[1]), str(live[0]), poll_seconds=POLL)
        refresher.start()
        try:
            assert await _served_certificate(port) == _der(first[1])
            _install(second, live)
            assert await _wait_for(port, _der(second[1])) == _der(second[1])

            # A certificate that does not match the key, as between two writes: refused,
            # logged, and the chain in use stays.
            shutil.copyfile(first[1], live[1])
            await asyncio.sleep(10 * POLL)
            assert await _served_certificate(port) == _der(second[1])
            assert "TLS files changed but cannot be loaded" in caplog.text

            # Its key arrives: the pair is whole again and is taken.
            shutil.copyfile(first[0], live[0])
            assert await _wait_for(port, _der(first[1])) == _der(first[1])
            assert "Reloaded the TLS certificate chain" in caplog.text
        finally:
            await refresher.stop()
            await runner.cleanup()

    with caplog.at_level(logging.INFO, logger="aioserve"):
        asyncio.run(scenario())


def test_without_refresh_the_server_keeps_its_certificate(tmp_path):
    # The control: the same rotation, nobody watching, the first certificate stays.
    first, second = _self_signed(tmp_path, "first"), _self_signed(tmp_path, "second")
    live = (tmp_path / "live.key", tmp_path / "live.pem")
    _install(first, live)

    async def scenario() -> None:
        _, runner, port = await _tls_server(live)
        try:
            _install(second, live)
            await asyncio.sleep(10 * POLL)
            assert await _served_certificate(port) == _der(first[1])
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
