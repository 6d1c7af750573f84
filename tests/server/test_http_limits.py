"""vLLM's HTTP-layer flags on the runner `aioserve serve` uses (server/http_runner.py):
--h11-max-header-count, --h11-max-incomplete-event-size, --disable-access-log-for-endpoints.

The header limits are tested over raw sockets, as a client flooding headers would send
them: a head sent whole in one write, or dribbled in small writes with its final CRLF held
back (h11 refuses a head only while its end has not arrived, so the held head is the one
its limit is about). The
references: uvicorn's H11Protocol answers any h11 parse error, its "Receive buffer too
long" included, with 400 and closes the connection; vLLM's UvicornAccessLogFilter drops
the lines whose urlparse'd path is one of the excluded ones. The app is a stub that
answers every path (the runner is what is tested; tests/server/test_app.py serves the
whole app with it).
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from aiohttp import web

from aioserve.config.frontend import frontend_config
from aioserve.log_setup import ACCESS_LOGGER
from aioserve.server.http_runner import logged_path, make_runner


async def _answer(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(text=f"{request.method} {request.path} {len(body)}")


def _app() -> web.Application:
    app = web.Application(client_max_size=2**24)
    app.router.add_route("*", "/{tail:.*}", _answer)
    return app


@contextmanager
def serving(server_loop, **frontend) -> Iterator[int]:
    """The stub app behind make_runner(frontend_config(**frontend)) on 127.0.0.1: its port."""

    async def start() -> web.AppRunner:
        runner = make_runner(_app(), frontend_config(**frontend))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = server_loop.run(start())
    try:
        yield runner.addresses[0][1]
    finally:
        server_loop.run(runner.cleanup())


def head(*lines: str, path: str = "/", method: str = "GET") -> bytes:
    """A request head with `lines` after Host (so len(lines) + 1 headers)."""
    text = f"{method} {path} HTTP/1.1\r\nHost: test\r\n" + "".join(f"{h}\r\n" for h in lines)
    return (text + "\r\n").encode()


def exchange(
    port: int, *requests: bytes, piece: int = 0, hold: float = 0.3
) -> list[tuple[int, bytes]]:
    """Send `requests` on one connection, each whole (piece=0) or dribbled: its head but
    the final CRLF in writes of `piece` bytes, then, unless an answer comes within `hold`
    seconds, the rest. However the server's reads split the bytes, it holds an incomplete
    head of all but 2 bytes (h11's case). (status, body) of each answer, up to the first
    that closes the connection."""
    answers = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as connection:
        reader = connection.makefile("rb")

        def answered(wait: float = 0) -> bool:
            return bool(select.select([connection], [], [], wait)[0])

        for request in requests:
            try:
                if piece:
                    cut = request.index(b"\r\n\r\n") + 2
                    parts = [request[i : min(i + piece, cut)] for i in range(0, cut, piece)]
                    for part in parts:
                        if answered():
                            break  # refused already: more bytes would only reset the line
                        connection.sendall(part)
                    if not answered(hold):
                        rest = request[cut:]
                        for start in range(0, len(rest), piece):
                            connection.sendall(rest[start : start + piece])
                else:
                    connection.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused midway: its answer is waiting
            status_line = reader.readline()
            status = int(status_line.split()[1])
            headers = {}
            while (line := reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                headers[name.strip().lower()] = value.strip()
            answers.append((status, reader.read(int(headers.get("content-length", 0)))))
            if headers.get("connection", "").lower() == "close" or status_line.startswith(
                b"HTTP/1.0"
            ):
                assert reader.read() == b"", "the connection stays open after a refusal"
                break
    return answers


# --- --h11-max-header-count ---------------------------------------------------------------


def test_the_header_count_limit_takes_that_many_headers_and_refuses_one_more(server_loop):
    with serving(server_loop, h11_max_header_count=8) as port:
        seven = [f"X-Trace-{i}: x" for i in range(7)]  # with Host: 8
        assert exchange(port, head(*seven)) == [(200, b"GET / 0")]
        [(status, body)] = exchange(port, head(*seven, "X-One-More: x"))
        assert status == 400 and body == b"Too many headers received"


def test_the_default_header_count_is_vllms_256(server_loop):
    with serving(server_loop) as port:
        headers = [f"X-Trace-{i}: x" for i in range(255)]
        assert exchange(port, head(*headers)) == [(200, b"GET / 0")]
        assert exchange(port, head(*headers, "X-One-More: x"))[0][0] == 400


# --- --h11-max-incomplete-event-size ------------------------------------------------------


def test_a_head_still_incomplete_past_the_limit_is_refused_as_h11_refuses_it(server_loop):
    big = [f"X-Big-{i}: {'a' * 6000}" for i in range(3)]  # 18 KiB of head, no line over 6 KiB
    with serving(server_loop, h11_max_incomplete_event_size=16384) as port:
        [(status, body)] = exchange(port, head(*big), piece=1024, hold=30)
        assert status == 400 and body.startswith(b"Request header fields too large")
        # Under the limit, dribbled as slowly, it is served.
        assert exchange(port, head(*big[:2]), piece=1024) == [(200, b"GET / 0")]
    with serving(server_loop, h11_max_incomplete_event_size=32768) as port:
        assert exchange(port, head(*big), piece=1024) == [(200, b"GET / 0")]


def test_one_line_over_the_limit_is_refused_even_in_one_write(server_loop):
    with serving(server_loop, h11_max_incomplete_event_size=4096) as port:
        [(status, body)] = exchange(port, head(f"X-Long: {'a' * 5000}"))
        assert status == 400 and body.startswith(b"Got more than 4096 bytes")
        [(status, _)] = exchange(port, f"GET /{'p' * 5000} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        assert status == 400


def test_bodies_do_not_count_and_each_request_of_a_connection_has_its_own_head(server_loop):
    body = b"x" * 200_000
    post = head(f"Content-Length: {len(body)}", method="POST", path="/upload") + body
    near_limit = head(*[f"X-Big-{i}: {'a' * 3000}" for i in range(4)])  # ~12 KiB of head
    with serving(server_loop, h11_max_incomplete_event_size=16384) as port:
        # Three heads of 12 KiB in a row: 36 KiB on the connection, each under the limit.
        answers = exchange(port, post, near_limit, near_limit, post, near_limit, piece=4096)
        get, posted = (200, b"GET / 0"), (200, b"POST /upload 200000")
        assert answers == [posted, get, get, posted, get]


def test_the_default_limit_refuses_what_uvicorns_h11_refuses_and_no_line_limit_would(
    server_loop,
):
    """5 MiB of head in 200 headers of 26 KiB: each line is far under 4 MiB, the head is
    over it; h11 (uvicorn's 400) refuses it, so does aioserve; 3 MiB passes."""
    lines = [f"X-Trace-{i}: {'a' * 26_000}" for i in range(200)]
    with serving(server_loop) as port:
        [(status, body)] = exchange(port, head(*lines), piece=65536, hold=30)
        assert status == 400 and b"(the limit is 4194304)" in body
        assert exchange(port, head(*lines[:120]), piece=65536) == [(200, b"GET / 0")]


# --- --disable-access-log-for-endpoints ---------------------------------------------------


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("/health", "/health"),
        ("/health?verbose=1", "/health"),
        ("/heal%74h", "/health"),  # uvicorn logs the decoded path, quoted again
        ("/health/", "/health/"),
        ("/a%20b", "/a%20b"),
        # An absolute-form target: uvicorn's quote() turns its ":" into %3A, so urlparse
        # finds no scheme and vLLM's filter matches none of its paths.
        ("http://example.com/health", "http%3A//example.com/health"),
    ],
)
def test_the_path_matched_is_the_one_vllms_filter_reads_from_uvicorns_line(target, path):
    assert logged_path(target) == path


def test_listed_paths_leave_no_access_log_line_and_others_do(server_loop, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    requests = ["/health", "/health?probe=1", "/heal%74h", "/metrics", "/health/", "/v1/models"]
    requests += ["/api/health"]  # under a root path: a path of its own, as in vLLM
    requests += ["/a%20b"]  # uvicorn's line (so vLLM's filter) has "/a%20b", not "/a b"
    excluded = ["/health", "/metrics", "/a%20b"]
    with serving(server_loop, disable_access_log_for_endpoints=excluded) as port:
        for target in requests:
            assert exchange(port, f"GET {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())[0][0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert [line.split('"')[1] for line in lines] == [
        "GET /health/ HTTP/1.1",
        "GET /v1/models HTTP/1.1",
        "GET /api/health HTTP/1.1",
    ]
    caplog.clear()
    with serving(server_loop) as port:  # nothing listed: every line
        for target in requests:
            exchange(port, f"GET {target} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    assert len([r for r in caplog.records if r.name == ACCESS_LOGGER]) == len(requests)
