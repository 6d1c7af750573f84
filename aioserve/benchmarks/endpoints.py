"""The client side of `bench serve`: one streamed request to an OpenAI-compatible endpoint.

`send_request` posts a completions or chat completions request with `stream: true` and
`stream_options.include_usage`, reads the server-sent events as they arrive and records
when the first and every later chunk carrying a choice came, the text, and the token
counts of the final usage chunk. Anything that goes wrong (an HTTP error, an error event,
a malformed stream, a dropped connection) fails that request with a message; it never
stops the benchmark. `call_profiler` starts or stops the server's profiler (--profile),
and does stop the benchmark when the server cannot.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from aioserve.benchmarks.datasets import SampleRequest
from aioserve.benchmarks.statistics import RequestResult
from aioserve.config.declaration import ConfigError

# Backend -> the endpoint it talks to when --endpoint is not given. "vllm" is vLLM's name
# for the completions backend.
BACKENDS = {
    "openai": "/v1/completions",
    "vllm": "/v1/completions",
    "openai-chat": "/v1/chat/completions",
}
CHAT_BACKENDS = ("openai-chat",)
TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE_END = re.compile(rb"\r\n|\n|\r")


class SSEDecoder:
    """Splits a server-sent event stream, fed in arbitrary pieces, into its events' data.

    An event ends with a blank line; its data is its `data:` lines joined by newlines.
    Comment lines (`: ping`) and other fields are skipped.
    """

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event completed by `chunk`."""
        self._buffer += chunk
        events = []
        while match := _EVENT_END.search(self._buffer):
            raw, self._buffer = self._buffer[: match.start()], self._buffer[match.end() :]
            events += self._data(raw)
        return events

    def finish(self) -> list[str]:
        """The data of an event the stream ended without closing."""
        raw, self._buffer = self._buffer, b""
        return self._data(raw)

    @staticmethod
    def _data(raw: bytes) -> list[str]:
        lines = [
            line[5:].removeprefix(b" ")
            for line in _LINE_END.split(raw)
            if line.startswith(b"data:")
        ]
        return [b"\n".join(lines).decode("utf-8")] if lines else []


@dataclass(frozen=True)
class Target:
    """Where and how every request of a run is sent."""

    url: str
    model: str
    chat: bool
    headers: dict[str, str]
    extra_body: dict[str, Any]
    ignore_eos: bool
    logprobs: int | None = None  # completions only, as in vLLM's chat requests
    pooling: bool = False  # an embeddings request (pooling.py), not a streamed generation


def request_payload(target: Target, request: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streamed request, as vLLM's benchmark builds it.

    Completions requests always carry `repetition_penalty: 1.0` and `logprobs` (null
    unless --logprobs), before --extra-body and the sampling options are merged in.
    """
    model = request.model or target.model
    if target.chat:
        payload: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": request.prompt}],
            "max_completion_tokens": request.expected_output_len,
        }
    else:
        payload = {
            "model": model,
            "prompt": request.prompt,
            "repetition_penalty": 1.0,
            "max_tokens": request.expected_output_len,
            "logprobs": target.logprobs,
        }
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    if target.ignore_eos:
        payload["ignore_eos"] = True
    payload.update(target.extra_body)
    return payload


async def send_request(
    session: aiohttp.ClientSession,
    target: Target,
    request: SampleRequest,
    request_id: str | None = None,
) -> RequestResult:
    """Send one streamed request and time its chunks; failures are recorded, not raised."""
    result = RequestResult(prompt_len=request.prompt_len)
    headers = dict(target.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id
    text: list[str] = []
    start = last = time.perf_counter()
    result.start_time = start
    try:
        async with session.post(
            target.url, json=request_payload(target, request), headers=headers
        ) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                result.error = f"HTTP {response.status} {response.reason}: {body}"
                return result
            decoder = SSEDecoder()

            def handle(data: str) -> None:
                nonlocal last
                if data == "[DONE]":
                    return
                message = json.loads(data)
                if "error" in message:
                    raise RuntimeError(f"error in the stream: {message['error']}")
                if choices := message.get("choices"):
                    now = time.perf_counter()
                    if target.chat:
                        piece = (choices[0].get("delta") or {}).get("content")
                    else:
                        piece = choices[0].get("text")
                    if not result.success:
                        result.success = True
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece or "")
                if usage := message.get("usage"):
                    if isinstance(usage.get("completion_tokens"), int):
                        result.output_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        result.prompt_len = usage["prompt_tokens"]

            async for chunk in response.content.iter_any():
                for data in decoder.feed(chunk):
                    handle(data)
            for data in decoder.finish():
                handle(data)
        if not result.success:
            result.error = "the stream ended without any chunk carrying a choice"
    except Exception as error:  # a misbehaving server fails its request, not the benchmark
        result.success = False
        result.error = f"{type(error).__name__}: {error}"
    result.generated_text = "".join(text)
    result.latency = last - start
    return result


async def call_profiler(
    session: aiohttp.ClientSession, base_url: str, action: str, headers: dict[str, str]
) -> None:
    """POST /start_profile or /stop_profile (`action` "start" or "stop") to the server at
    `base_url`; ConfigError saying what it answered unless 200."""
    url = f"{base_url}/{action}_profile"
    async with session.post(url, headers=headers) as response:
        if response.status == 200:
            return
        text = (await response.text()).strip()
    hint = " (start the server with VLLM_TORCH_PROFILER_DIR)" if response.status == 404 else ""
    raise ConfigError(f"--profile: {url} answered {response.status}{hint}: {text[:300]}")
