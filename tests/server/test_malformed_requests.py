"""Malformed requests against a real `python -m aioserve serve` process.

Each kind of bad request (sent with raw aiohttp: the `openai` client would refuse some of
them itself, or a raw socket for a body over the size limit) must get its status and an
OpenAI error body naming the field, with the error classes of the `openai` client and
vLLM 0.32's recorded error bodies as references; afterwards the server serves normally
and nothing refused left a request or a KV block behind. The server is conftest.py's
`server_process`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from aioserve.server.middlewares import MAX_REQUEST_BODY_BYTES
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, sample, send_oversized_head
from tests.server.serve_process import (
    API_KEY,
    AUTH,
    MAX_MODEL_LEN,
    fetch,
    openai_error,
    wait_until_metrics_idle,
)

pytestmark = pytest.mark.slow

# vLLM 0.32's recorded requests on this model, the base of some malformed ones.
VLLM_COMPLETION = sample("04_completion")
VLLM_CHAT = sample("07_chat")
PROMPT = VLLM_COMPLETION["request"]["body"]["prompt"]

COMPLETION = {"prompt": "Hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@dataclass(frozen=True)
class Malformed:
    """A bad request and what must come back: the status, `param`, words in the message."""

    path: str
    body: Any = None
    raw: bytes | None = None
    status: int = 400
    param: str | None = None
    mentions: tuple[str, ...] = ()
    """Strings the message must contain; by default `param`, the field it names."""
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: dict(AUTH))
    vllm_sample: str | None = None
    """A vLLM sample whose error body (same request) ours must equal exactly."""


def completion(param: str | None = None, *mentions: str, **fields: Any) -> Malformed:
    """A /v1/completions request with `fields` over a valid body, refused for `param`."""
    return Malformed("/v1/completions", COMPLETION | fields, param=param, mentions=mentions)


def chat(param: str | None = None, *mentions: str, **fields: Any) -> Malformed:
    """A /v1/chat/completions request with `fields` over a valid body, refused for `param`."""
    return Malformed("/v1/chat/completions", CHAT | fields, param=param, mentions=mentions)


MALFORMED = {
    # -- bodies that are not a JSON object
    "bad JSON": Malformed(
        "/v1/chat/completions", raw=b'{"model": "x", "messages": [', param="body"
    ),
    "JSON array body": Malformed("/v1/completions", raw=b'[{"prompt": "Hi"}]', param="body"),
    "body not UTF-8": Malformed("/v1/completions", raw=b"\xff\xfe{}", param="body"),
    "missing prompt": Malformed("/v1/completions", {"max_tokens": 2}, param="prompt"),
    "missing messages": Malformed("/v1/chat/completions", {"max_tokens": 2}, param="messages"),
    # -- wrong types
    "prompt as int": completion("prompt", "42", prompt=42),
    "messages as string": chat("messages", "Hi there", messages="Hi there"),
    "temperature as string": completion("temperature", "hot", temperature="hot"),
    "max_tokens as float string": completion("max_tokens", "8.5", max_tokens="8.5"),
    "max_tokens as boolean": completion("max_tokens", "true", max_tokens=True),
    "n as list": completion("n", n=[2]),
    "stop as int": completion("stop", "7", stop=7),
    "logit_bias with a non-int key": completion("logit_bias", "abc", logit_bias={"abc": 1}),
    "stream as string": completion("stream", "yes", stream="yes"),
    "seed as string": completion("seed", "lucky", seed="lucky"),
    "stop_token_ids of strings": completion("stop_token_ids", stop_token_ids=["a"]),
    "message content as int": chat(
        "messages[0].content", messages=[{"role": "user", "content": 5}]
    ),
    # -- values out of range
    "temperature -1": Malformed(
        "/v1/chat/completions",
        VLLM_CHAT["request"]["body"] | {"temperature": -1, "max_tokens": 4},
        param="temperature",
        vllm_sample="20_err_temperature_neg",
    ),
    "top_p 0": completion("top_p", "0", top_p=0),
    "top_p 1.5": completion("top_p", "1.5", top_p=1.5),
    "top_k -2": completion("top_k", "-2", top_k=-2),
    "temperature 3": completion("temperature", "3", temperature=3),
    "n 0": completion("n", "0", n=0),
    "n 2 under greedy sampling": completion("n", "2", n=2, temperature=0),
    "max_tokens 0": completion("max_tokens", "0", max_tokens=0),
    "max_tokens -1": Malformed(
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -1},
        param="max_tokens",
        vllm_sample="15_err_completion_max_tokens_neg",
    ),
    "max_tokens -1 in a chat stream": Malformed(
        "/v1/chat/completions",
        VLLM_CHAT["request"]["body"] | {"max_tokens": -1, "stream": True},
        param="max_tokens",
        vllm_sample="22_err_stream_max_tokens_neg",
    ),
    "presence_penalty 3": completion("presence_penalty", "3", presence_penalty=3),
    "frequency_penalty -3": completion("frequency_penalty", "-3", frequency_penalty=-3),
    "repetition_penalty 0": completion("repetition_penalty", "0", repetition_penalty=0),
    "min_p 2": completion("min_p", "2", min_p=2),
    "logprobs 100": completion("logprobs", "100", logprobs=100),
    "logprobs -1": completion("logprobs", "-1", logprobs=-1),
    "top_logprobs 30": chat("top_logprobs", "30", logprobs=True, top_logprobs=30),
    "top_logprobs without logprobs": chat("top_logprobs", top_logprobs=2),
    "min_tokens over max_tokens": completion("min_tokens", "5", min_tokens=5, max_tokens=2),
    "include_usage as string": completion(
        "stream_options.include_usage", stream=True, stream_options={"include_usage": "yes"}
    ),
    "stream_options without stream": completion(
        "stream_options", stream_options={"include_usage": True}
    ),
    "logit_bias token outside the vocabulary": completion(
        "logit_bias", "99999", logit_bias={"99999": 1}
    ),
    # -- prompts and messages
    "empty prompt": completion("prompt", prompt=""),
    "empty token id prompt": completion("prompt", prompt=[]),
    # SmolLM2's vocabulary holds token ids 0 to 49151.
    "token id outside the vocabulary": completion("prompt", "49152", prompt=[504, 49152]),
    "negative token id": completion("prompt", "-5", prompt=[504, -5]),
    "prompt longer than the context": completion(
        "input_tokens", "1024", "1025", prompt=[504] * (MAX_MODEL_LEN + 1)
    ),
    "chat longer than the context": chat(
        "input_tokens", "1024", messages=[{"role": "user", "content": "hello " * MAX_MODEL_LEN}]
    ),
    "max_tokens beyond the context": completion(
        "max_tokens", f"max_model_len={MAX_MODEL_LEN}", max_tokens=MAX_MODEL_LEN + 1, prompt="Hi"
    ),
    "empty messages": chat("messages", messages=[]),
    "message without role": chat("messages[0].role", messages=[{"content": "Hi"}]),
    "suffix": completion("suffix", suffix="!"),
    # -- model, route, method, key
    "unknown model": Malformed(
        "/v1/completions",
        COMPLETION | {"model": "no-such-model"},
        status=404,
        param="model",
        mentions=("no-such-model",),
    ),
    "unknown route": Malformed("/v1/nothing", COMPLETION, status=404, mentions=("/v1/nothing",)),
    "wrong method": Malformed(
        "/v1/completions", method="GET", status=405, mentions=("GET /v1/completions",)
    ),
    "user as int": completion("user", user=5),
    "stop token id outside the vocabulary": completion("stop_token_ids", "-1", stop_token_ids=[-1]),
    # vLLM lets a message leave its content out, but only an assistant's be null.
    "user message with null content": chat(
        "messages[0].content", messages=[{"role": "user", "content": None}]
    ),
    "no API key": Malformed("/v1/completions", COMPLETION, status=401, headers={}),
    "wrong API key": Malformed(
        "/v1/completions", COMPLETION, status=401, headers={"Authorization": "Bearer wrong"}
    ),
}


MALFORMED_CASES = [pytest.param(case, id=name) for name, case in MALFORMED.items()]


@pytest.mark.parametrize("case", MALFORMED_CASES)
def test_malformed_request_gets_its_status_and_an_openai_error(server_process, case: Malformed):
    url = server_process.url + case.path
    reply = fetch(case.method, url, body=case.body, raw=case.raw, headers=case.headers)
    assert reply.status == case.status, reply.body
    error = openai_error(reply)
    if case.vllm_sample is not None:
        assert reply.json() == sample(case.vllm_sample)["response"]["body"]
    if case.param is not None:
        assert error["param"] == case.param
    for text in case.mentions or ((case.param,) if case.param else ()):
        assert text in error["message"], error["message"]


def test_a_body_over_the_size_limit_is_a_413(server_process):
    reply = send_oversized_head(
        server_process.url,
        "/v1/completions",
        MAX_REQUEST_BODY_BYTES,
        headers=f"Authorization: Bearer {API_KEY}\r\n",
    )
    assert reply.status == 413
    assert str(MAX_REQUEST_BODY_BYTES) in openai_error(reply)["message"]


def test_the_server_serves_normally_after_malformed_requests(server_process, server_process_client):
    with pytest.raises(openai.AuthenticationError):
        client(server_process.url, "wrong").completions.create(model=MODEL, prompt="Hi")
    result = server_process_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert result.usage.completion_tokens == 2 and result.choices[0].text
    assert server_process.process.poll() is None
    wait_until_metrics_idle(
        server_process.url
    )  # nothing refused left a request or a KV block behind
    assert "Traceback" not in server_process.log.read_text(errors="replace")
