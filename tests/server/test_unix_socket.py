"""--uds PATH: the server on a Unix domain socket (server/unix_socket.py).

vLLM's behaviour is the reference where it has one (launchers/launcher.py): --host and
--port ignored, TLS served over the socket when a certificate is given, "unix:<path>" as
the address it logs. Where vLLM has none (it binds with a plain bind(), so a socket left
by a crash stops the next start, and leaves the file when it stops), the tests check
aioserve's rules: a stale socket is replaced, a live one or a file that is not a socket
is never touched, and the server removes its own socket file when it stops.

The unit tests use sockets bound in the test's temporary folder; the app tests serve the
whole app on the default model in-process, reached with aiohttp's UnixConnector and the
official `openai` client over an HTTP transport on the socket; the last test runs
`python -m aioserve serve --uds` on the tiny model under a stand-in for systemd.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from aioserve import __version__
from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.server.app import build_app
from aioserve.server.serve import _listen, _log_started, build_ssl_context, make_runner
from aioserve.server.state import ServerState
from aioserve.server.unix_socket import MAX_PATH_BYTES, UnixSocket, check_socket_path
from tests.child_process import start_logged
from tests.server.conftest import MODEL
from tests.server.serve_process import START_LIMIT_S
from tests.server.test_systemd_notify import FakeSystemd

try:  # the HTTP library the installed openai client is built on
    import httpx2 as httpx
except ImportError:
    import httpx

TIMEOUT = aiohttp.ClientTimeout(total=120)


def stale_socket(path: Path) -> None:
    """A socket file at `path` that nobody listens on, as a killed server leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


@contextmanager
def live_socket(path: Path) -> Iterator[None]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
        sock.listen()
        yield


# --- the path ---------------------------------------------------------------------------------


def test_a_free_path_or_a_stale_socket_is_accepted(tmp_path):
    check_socket_path(str(tmp_path / "api.sock"))
    stale_socket(tmp_path / "stale.sock")
    check_socket_path(str(tmp_path / "stale.sock"))


def test_paths_that_cannot_be_had_are_refused_by_name(tmp_path):
    (tmp_path / "file").write_text("not a socket")
    with live_socket(tmp_path / "live.sock"):
        refusals = {
            str(tmp_path / "no" / "api.sock"): "the folder",
            str(tmp_path / "file"): "the path exists and is not a socket; not removing it",
            str(tmp_path / "live.sock"): "another server is listening on this socket",
            "/tmp/" + "s" * MAX_PATH_BYTES: f"a Unix socket path has at most {MAX_PATH_BYTES}",
        }
        for path, message in refusals.items():
            with pytest.raises(ConfigError) as error:
                check_socket_path(path)
            assert str(error.value).startswith(f"--uds {path}: ") and message in str(error.value)
        # Neither the file nor the live socket was touched.
        assert (tmp_path / "file").read_text() == "not a socket"
        assert (tmp_path / "live.sock").is_socket()


def test_bind_replaces_a_stale_socket_and_remove_deletes_only_its_own(tmp_path, caplog):
    path = tmp_path / "api.sock"
    stale_socket(path)
    listener = UnixSocket(str(path))
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        sock = listener.bind()
    assert "removing the socket a stopped server left" in caplog.text
    sock.listen()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))  # the new socket answers
    sock.close()
    listener.remove()
    assert not path.exists()
    # A socket put there by another server after ours is not ours to remove.
    other = UnixSocket(str(path))
    other.bind().close()
    path.unlink()
    time.sleep(0.05)  # file times tick by the kernel's coarse clock (a few ms)
    stale_socket(path)
    other.remove()
    assert path.is_socket()


def test_bind_refuses_a_live_socket(tmp_path):
    path = tmp_path / "api.sock"
    with live_socket(path):
        with pytest.raises(ConfigError, match="another server is listening on this socket"):
            UnixSocket(str(path)).bind()
        assert path.is_socket()


# --- the app on a socket ---------------------------------------------------------------------


def openai_client(path: Path, tls: ssl.SSLContext | None = None) -> openai.OpenAI:
    """The official client, its requests sent over the socket at `path` (with TLS trusting
    `tls`'s CAs, if given)."""
    transport = httpx.HTTPTransport(uds=str(path), verify=tls or True)
    return openai.OpenAI(
        base_url=f"{'https' if tls else 'http'}://localhost/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.Client(transport=transport, timeout=120),
    )


async def get(path: Path, route: str) -> tuple[int, bytes]:
    """GET `route` over the socket at `path`, plain HTTP (aiohttp's connector has no TLS)."""
    connector = aiohttp.UnixConnector(path=str(path))
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:
        async with session.get(f"http://localhost{route}") as response:
            return response.status, await response.read()


@contextmanager
def served_on_socket(server_loop, engine, *argv: str) -> Iterator[web.AppRunner]:
    """The app of `aioserve serve <argv>` listening as serve listens (its _listen)."""
    options = frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))
    unix_socket = UnixSocket(options.uds)
    app = build_app(ServerState(engine, [MODEL], options))

    async def start() -> web.AppRunner:
        runner = make_runner(app, options)
        await runner.setup()
        await _listen(runner, options, build_ssl_context(options), unix_socket)
        return runner

    runner = server_loop.run(start())
    try:
        yield runner
    finally:
        server_loop.run(runner.cleanup())
        unix_socket.remove()


def test_the_app_answers_on_the_socket_and_the_address_is_logged_as_vllm_logs_it(
    server_loop, engine, tmp_path, caplog
):
    path = tmp_path / "api.sock"
    with served_on_socket(server_loop, engine, "--uds", str(path), "--port", "1") as runner:
        assert runner.addresses == [str(path)]
        assert asyncio.run(get(path, "/health")) == (200, b"")
        client = openai_client(path)
        assert [model.id for model in client.models.list()] == [MODEL]
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=3,
            temperature=0,
            stream=True,
        )
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
        with caplog.at_level(logging.INFO, logger="aioserve"):
            frontend = frontend_config_from_args(
                build_engine_parser("aioserve serve").parse_args(["--uds", str(path)])
            )
            _log_started(runner.app, runner, frontend, False, "aioserve ready in 1.0 s")
        assert f"Starting aioserve API server on unix:{path}\n" in caplog.text + "\n"
    assert not path.exists()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_is_served_over_the_socket_as_vllm_serves_it(server_loop, engine, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    path = tmp_path / "api.sock"
    argv = ["--uds", str(path), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    with served_on_socket(server_loop, engine, *argv):
        trusted = ssl.create_default_context(cafile=str(cert))
        transport = httpx.HTTPTransport(uds=str(path), verify=trusted)
        with httpx.Client(transport=transport, timeout=60) as client:
            reply = client.get("https://localhost/version")
        assert reply.status_code == 200 and reply.json() == {"version": __version__}
        assert [m.id for m in openai_client(path, tls=trusted).models.list()] == [MODEL]
        with pytest.raises(aiohttp.ClientConnectionError):  # plain HTTP gets nowhere
            asyncio.run(get(path, "/version"))


# --- a real server process ------------------------------------------------------------------


def test_serve_on_a_socket_replaces_a_stale_one_says_ready_and_removes_its_own(
    tiny_model, tmp_path
):
    path = tmp_path / "api.sock"
    stale_socket(path)  # as a killed server leaves it
    systemd = FakeSystemd(str(tmp_path / "notify"))
    log = tmp_path / "serve.log"
    argv = [sys.executable, "-m", "aioserve", "serve", tiny_model, "--uds", str(path)]
    argv += ["--host", "127.0.0.1", "--enforce-eager", "--max-model-len", "256"]
    argv += ["--num-gpu-blocks-override", "64", "--served-model-name", "tiny"]
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    environment["NOTIFY_SOCKET"] = systemd.address
    process = start_logged(argv, log, environment)
    try:
        systemd.wait_for("READY=1", START_LIMIT_S, process)
        # Ready means answering on the socket: no retry, no wait.
        assert asyncio.run(get(path, "/health")) == (200, b"")
        completion = openai_client(path).completions.create(
            model="tiny", prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert completion.usage.completion_tokens == 4
        # A second server on the same path stops at once, leaving the first one's socket.
        second = subprocess.run(
            [sys.executable, "-m", "aioserve", "serve", tiny_model, "--uds", str(path)],
            capture_output=True, text=True, timeout=120, env=environment,
        )  # fmt: skip
        assert second.returncode == 2
        assert f"--uds {path}: another server is listening on this socket" in second.stderr
        assert asyncio.run(get(path, "/health"))[0] == 200
        process.send_signal(signal.SIGTERM)
        systemd.wait_for("STOPPING=1", 60, process)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        systemd.close()
    text = log.read_text()
    assert "--uds " + str(path) + ": removing the socket a stopped server left" in text
    assert "--host and --port are ignored: the server listens on --uds" in text
    assert f"Starting aioserve API server on unix:{path}\n" in text
    assert text.index(f"on unix:{path}") < text.index("Application startup complete.")
    assert not path.exists()  # removed at exit
