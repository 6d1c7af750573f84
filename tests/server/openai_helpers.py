"""Helpers for the OpenAI route tests: raw HTTP calls, SSE parsing, vLLM's reference samples.

`vllm_samples/` holds requests and responses captured from a real vLLM 0.32 serving the
same model (copied from the project's shared reference). Tests compare the *shape* of our
answers with them: the keys of every object, in order, not the generated text.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai

SAMPLES = Path(__file__).parent / "vllm_samples"
TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    base_url: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    """POST a JSON body (or raw bytes), with `headers` too, and read the whole answer."""

    async def call() -> Reply:
        data = raw if raw is not None else json.dumps(body).encode()
        headers_sent = {"Content-Type": "application/json", **(headers or {})}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(base_url + path, data=data, headers=headers_sent) as response:
                return Reply(response.status, dict(response.headers), await response.read())

    return asyncio.run(call())


def send_oversized_head(base_url: str, path: str, limit: int, headers: str = "") -> Reply:
    """POST only the head of a request whose Content-Length is `limit` + 1; read the answer.

    No body follows: the server must refuse from the Content-Length alone, not read it.
    `headers` are extra header lines, each ending with CRLF. The answer is read up to its
    Content-Length, not to the connection's end: aiohttp lingers up to 10 s for the body
    it will not read before it closes.
    """
    host, port = base_url.removeprefix("http://").split(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"{headers}Content-Length: {limit + 1}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(head.encode())
        received = b""
        while b"\r\n\r\n" not in received and (chunk := connection.recv(65536)):
            received += chunk
        status_line, _, rest = received.partition(b"\r\n")
        raw_headers, _, body = rest.partition(b"\r\n\r\n")
        parsed = dict(
            line.decode().split(": ", 1) for line in raw_headers.split(b"\r\n") if b": " in line
        )
        while len(body) < int(parsed["Content-Length"]) and (chunk := connection.recv(65536)):
            body += chunk
    return Reply(int(status_line.split(b" ", 2)[1]), parsed, body)


def client(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    """The official client on `base_url`'s /v1 routes: no retries, a 120 s timeout."""
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)


def sample(name: str) -> dict[str, Any]:
    """A recorded request/response pair, e.g. sample("04_completion")."""
    return json.loads((SAMPLES / f"{name}.json").read_text())


def sample_stream(name: str) -> bytes:
    """The recorded bytes of a streamed response, e.g. sample_stream("06_completion_stream")."""
    return (SAMPLES / f"{name}.sse").read_bytes()


def sse_events(raw: bytes) -> list[Any]:
    """The JSON events of an SSE body, checking vLLM's framing on the way.

    Every event is `data: <compact JSON>\\n\\n`, the last one `data: [DONE]\\n\\n`, and
    nothing else is sent.
    """
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    frames = raw[: -len(b"data: [DONE]\n\n")].split(b"\n\n")
    assert frames[-1] == b""
    events = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame, frame
        payload = frame[len(b"data: ") :]
        event = json.loads(payload)
        # Compact JSON, as vLLM writes it (no spaces after separators).
        assert payload == json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
        events.append(event)
    return events


def shape(value: Any) -> Any:
    """The keys of every object in `value`, in order, recursively (lists by first item).

    In completions logprobs (the object with `text_offset`), the keys of the
    `top_logprobs` objects are tokens, not field names: they are left out.
    """
    if isinstance(value, dict):
        return [
            (key, "tokens" if key == "top_logprobs" and "text_offset" in value else shape(item))
            for key, item in value.items()
        ]
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return None


def distinct_shapes(events: list[Any]) -> list[Any]:
    """The shapes of a stream's events with consecutive repeats collapsed."""
    shapes: list[Any] = []
    for event in events:
        if not shapes or shapes[-1] != shape(event):
            shapes.append(shape(event))
    return shapes


def validation_error_body(*errors: str, param: str) -> dict:
    """vLLM's 400 body for FastAPI's query validation errors (the dev routes' /pause,
    /sleep): each error as Python prints its dict."""
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:" + "".join(f"\n  {e}" for e in errors)
    return {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}}
