"""End to end: a real `python -m aioserve serve` process, driven over HTTP by the `openai` client.

One server for the whole module: the default model's GGUF on a free port of 127.0.0.1 with
`--max-model-len 1024 --seed 0 --api-key`, under the model name of vLLM's recorded samples;
its output goes to a log file whose tail is shown if it does not start, and it is killed
at the end whatever happens. The tests reach it only over real
HTTP: the official `openai` client (sync and async) for what users do, raw aiohttp for
malformed requests (the client would refuse some of them itself), a raw socket for a body
over the size limit.

References, all independent of the server: transformers' tokenizer loaded from the same
GGUF (prompt token counts, the chat template, the text of the returned token ids), vLLM
0.32's recorded answers on the same model (vllm_samples/), the same request sent alone or
not streamed, the error classes of the `openai` client, prometheus-client's parser, and
token counts known from the requests themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from transformers import AutoTokenizer

from aioserve.server.middlewares import MAX_REQUEST_BODY_BYTES
from tests.server.conftest import MODEL
from tests.server.openai_helpers import Reply, client, sample, send_oversized_head

pytestmark = pytest.mark.slow

API_KEY = "e2e-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
TIMEOUT = aiohttp.ClientTimeout(total=120)
START_LIMIT_S = 300
"""How long the server may take to load the model and answer /health."""

# vLLM 0.32's greedy completion and chat requests on this model; it counted 5 and 37
# prompt tokens for them.
VLLM_COMPLETION = sample("04_completion")
VLLM_CHAT = sample("07_chat")
PROMPT = VLLM_COMPLETION["request"]["body"]["prompt"]
QUESTION = VLLM_CHAT["request"]["body"]["messages"]
GREEDY_TOKENS = 12


# --- the server process ------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _wait_until_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{_log_tail(log)}")
        try:
            if fetch("GET", url + "/health", timeout=5).status == 200:
                return
        except (aiohttp.ClientError, TimeoutError):
            pass  # not listening yet
        time.sleep(0.5)
    pytest.fail(f"the server was not healthy after {START_LIMIT_S} s:\n{_log_tail(log)}")


@pytest.fixture(scope="module")
def server(smollm2_gguf, tmp_path_factory) -> Iterator[Server]:
    """`python -m aioserve serve` on the default model, healthy, killed after the module."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    port = _free_port()
    argv = [sys.executable, "-m", "aioserve", "serve", str(smollm2_gguf)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)]
    argv += ["--seed", "0", "--api-key", API_KEY]
    argv += ["--served-model-name", MODEL]  # the name in vLLM's recorded requests
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, stdout=output, stderr=subprocess.STDOUT, env=environment)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_healthy(process, url, log)
        assert [m.id for m in client(url, API_KEY).models.list()] == [MODEL]
        yield Server(url, process, log)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def openai_client(server: Server) -> openai.OpenAI:
    return client(server.url, API_KEY)


def async_client(server: Server) -> openai.AsyncOpenAI:
    """The official async client on the server; use it as `async with` in one event loop."""
    return openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    """The model's tokenizer as transformers loads it from the GGUF, apart from the server."""
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


# --- raw HTTP and metrics --------------------------------------------------------------------


def fetch(
    method: str,
    url: str,
    *,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
) -> Reply:
    """One request with aiohttp (a JSON `body` or `raw` bytes), the whole answer read."""

    async def call() -> Reply:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        limit = aiohttp.ClientTimeout(total=timeout)
        async with aiohttp.ClientSession(timeout=limit) as session:
            async with session.request(method, url, data=data, headers=sent) as response:
                return Reply(response.status, dict(response.headers), await response.read())

    return asyncio.run(call())


OPENAI_ERROR_TYPES = {
    400: openai.BadRequestError.__name__,
    401: openai.AuthenticationError.__name__,
    404: openai.NotFoundError.__name__,
}


def openai_error(reply: Reply) -> dict[str, Any]:
    """The error object of an OpenAI error body, checked for its shape, code and type."""
    body = reply.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == reply.status
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    if reply.status in OPENAI_ERROR_TYPES:
        assert error["type"] == OPENAI_ERROR_TYPES[reply.status]
    return error


async def _read_metrics(session: aiohttp.ClientSession, url: str) -> list[Sample]:
    async with session.get(url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    # The parser raises on anything that is not the Prometheus text format.
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def read_metrics(url: str) -> list[Sample]:
    """Every sample of GET /metrics, parsed by prometheus-client."""

    async def call() -> list[Sample]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            return await _read_metrics(session, url)

    return asyncio.run(call())


def metric(samples: list[Sample], name: str, **labels: str) -> float:
    """The value of the one sample called `name` whose labels include `labels`."""
    (value,) = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    return value


def moved(before: list[Sample], after: list[Sample], name: str, **labels: str) -> float:
    """How much the sample `name` (with `labels`) grew between two reads of /metrics."""
    return metric(after, name, **labels) - metric(before, name, **labels)


def wait_until_metrics_idle(url: str, limit: float = 10) -> list[Sample]:
    """/metrics once no request runs or waits and the KV cache is empty; fails after `limit` s."""
    deadline = time.monotonic() + limit
    while True:
        samples = read_metrics(url)
        busy = {
            name: metric(samples, name)
            for name in (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
            )
        }
        if not any(busy.values()):
            return samples
        assert time.monotonic() < deadline, f"still busy after {limit} s: {busy}"
        time.sleep(0.1)


# --- 1. completions and chat through the openai client ----------------------------------------


@pytest.fixture(scope="module")
def greedy_completion(server: Server, openai_client: openai.OpenAI):
    return openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )


@pytest.fixture(scope="module")
def greedy_chat(server: Server, openai_client: openai.OpenAI):
    return openai_client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True},
    )


def test_greedy_completion_has_exact_usage_and_logprobs(greedy_completion, hf_tokenizer):
    (choice,) = greedy_completion.choices
    usage = greedy_completion.usage
    assert usage.prompt_tokens == len(hf_tokenizer(PROMPT).input_ids)
    assert usage.prompt_tokens == VLLM_COMPLETION["response"]["body"]["usage"]["prompt_tokens"]
    token_ids = choice.token_ids
    assert usage.completion_tokens == len(token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert hf_tokenizer.decode(token_ids, skip_special_tokens=True) == choice.text
    assert choice.index == 0
    assert choice.finish_reason == ("length" if len(token_ids) == GREEDY_TOKENS else "stop")
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(token_ids)
    assert len(logprobs.top_logprobs) == len(token_ids)
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        # Greedy: the chosen token is the most likely one, so it is one of the 2 listed.
        assert len(top) == 2
        assert max(top, key=top.get) == token
        assert top[token] == logprob <= 0


def test_streamed_greedy_completion_is_the_full_one(server, openai_client, greedy_completion):
    stream = openai_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    *chunks, usage_chunk = list(stream)
    (expected,) = greedy_completion.choices
    assert chunks and all(len(c.choices) == 1 and c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    finish_reasons = [c.choices[0].finish_reason for c in chunks]
    assert finish_reasons == [None] * (len(chunks) - 1) + [expected.finish_reason]
    # The include_usage chunk: no choices, the totals of the whole request.
    assert usage_chunk.choices == []
    usage, full = usage_chunk.usage, greedy_completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.prompt_tokens,
        full.completion_tokens,
        full.total_tokens,
    )
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == usage.completion_tokens


def test_greedy_chat_has_exact_usage_and_top_logprobs(greedy_chat, hf_tokenizer):
    (choice,) = greedy_chat.choices
    usage = greedy_chat.usage
    template = hf_tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert usage.prompt_tokens == len(template["input_ids"])
    assert usage.prompt_tokens == VLLM_CHAT["response"]["body"]["usage"]["prompt_tokens"]
    token_ids = choice.token_ids
    assert usage.completion_tokens == len(token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert choice.message.role == "assistant"
    assert hf_tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
    assert choice.finish_reason == ("length" if len(token_ids) == GREEDY_TOKENS else "stop")
    assert len(choice.logprobs.content) == len(token_ids)
    for entry in choice.logprobs.content:
        assert len(entry.top_logprobs) == 2
        best, second = entry.top_logprobs
        assert (best.token, best.logprob) == (entry.token, entry.logprob)
        assert best.logprob >= second.logprob


def test_streamed_greedy_chat_is_the_full_one(server, openai_client, greedy_chat):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    role_chunk, *chunks, usage_chunk = list(stream)
    (expected,) = greedy_chat.choices
    assert role_chunk.choices[0].delta.role == "assistant"
    assert not role_chunk.choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.message.content
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert usage_chunk.choices == []
    usage, full = usage_chunk.usage, greedy_chat.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        full.prompt_tokens,
        full.completion_tokens,
        full.total_tokens,
    )


def test_n2_choices_are_indexed_and_seeded(server, openai_client, hf_tokenizer):
    reference = sample("05_completion_n2_logprobs")["request"]["body"]
    request = {
        "model": MODEL,
        "prompt": reference["prompt"],
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 1,
        "n": 2,
        "extra_body": {"return_token_ids": True},
    }
    first = openai_client.completions.create(**request)
    again = openai_client.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    # The prompt counts once, every sample's tokens count.
    assert first.usage.prompt_tokens == len(hf_tokenizer(reference["prompt"]).input_ids)
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)

    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 6}
    chat |= {"temperature": 0.8, "seed": 3, "n": 2}
    full = openai_client.chat.completions.create(**chat)
    assert [c.index for c in full.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in openai_client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in full.choices]


def _middle_word(text: str) -> str:
    """A word from the middle of `text` whose first occurrence is not at its start."""
    words = text.split()
    assert len(words) >= 2, f"too short a text to pick a stop string from: {text!r}"
    word = words[len(words) // 2]
    assert text.index(word) > 0
    return word


def test_stop_strings_end_the_text_before_them(
    server, openai_client, greedy_completion, greedy_chat
):
    text = greedy_completion.choices[0].text
    stop = _middle_word(text)
    result = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0, stop=[stop]
    )
    (choice,) = result.choices
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # vLLM's extra field: which stop string matched

    content = greedy_chat.choices[0].message.content
    stop = _middle_word(content)
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        stop=stop,
        stream=True,
    )
    chunks = [chunk for chunk in stream if chunk.choices]
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == content[: content.index(stop)]
    )
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_with_ignore_eos_runs_past_the_end_of_sequence(
    server, openai_client, hf_tokenizer
):
    # A bias of 100 makes the end-of-sequence token the model's only choice.
    forced_eos = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(hf_tokenizer.eos_token_id): 100},
    }
    stopped = openai_client.completions.create(**forced_eos)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    ignored = openai_client.completions.create(**forced_eos, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 4


def test_a_seed_fixes_the_sampled_text(server):
    async def sample_texts(seeds: list[int]) -> list[str]:
        async with async_client(server) as seeded_client:
            results = await asyncio.gather(
                *(
                    seeded_client.completions.create(
                        model=MODEL,
                        prompt="My favourite animal is",
                        max_tokens=8,
                        temperature=1.0,
                        seed=seed,
                    )
                    for seed in seeds
                )
            )
        return [result.choices[0].text for result in results]

    # Sent together (one batch), then the first again alone: the seed alone decides.
    texts = asyncio.run(sample_texts([11, 11, 12, 13]))
    (alone,) = asyncio.run(sample_texts([11]))
    assert texts[0] == texts[1] == alone
    # Different seeds at temperature 1 give different texts, almost surely.
    assert len({texts[0], texts[2], texts[3]}) > 1


# --- 2. many streams at once, and /health meanwhile -----------------------------------------

CONCURRENT_PROMPTS = [PROMPT, "Once upon a time", "The best way to learn is", "Water boils at"]
NUM_STREAMS = 64
HEALTH_BOUND_S = 2.0
"""A bound on one /health answer. It checks that model steps (~0.1-0.5 s each here) do not
block the event loop, not the server's speed: a blocked loop answers after whole steps."""


@dataclass
class StreamsAndProbes:
    texts: list[str]
    finish_reasons: list[str | None]
    probes: list[tuple[int, float, float]] = field(default_factory=list)
    """(status, seconds to answer, monotonic time answered) of each /health request."""
    streams_ended: float = 0.0


async def _streams_while_probing_health(server: Server, prompts: list[str]) -> StreamsAndProbes:
    streams_done = asyncio.Event()
    result = StreamsAndProbes([], [])

    async def probe_health(session: aiohttp.ClientSession) -> None:
        while not streams_done.is_set():
            sent = time.monotonic()
            async with session.get(server.url + "/health") as response:
                await response.read()
            answered = time.monotonic()
            result.probes.append((response.status, answered - sent, answered))
            await asyncio.sleep(0.05)

    async def stream_text(streams: openai.AsyncOpenAI, prompt: str) -> tuple[str, str | None]:
        stream = await streams.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        text, finish_reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return text, finish_reason

    async with async_client(server) as streams, aiohttp.ClientSession(timeout=TIMEOUT) as session:
        prober = asyncio.create_task(probe_health(session))
        try:
            outcomes = await asyncio.gather(*(stream_text(streams, p) for p in prompts))
            result.streams_ended = time.monotonic()
        finally:
            streams_done.set()
            await prober
    result.texts = [text for text, _ in outcomes]
    result.finish_reasons = [finish_reason for _, finish_reason in outcomes]
    return result


def test_64_concurrent_streams_get_their_solo_texts_while_health_answers(server, openai_client):
    solo = {}
    for prompt in CONCURRENT_PROMPTS:
        alone = openai_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0
        )
        solo[prompt] = alone.choices[0].text
    prompts = [CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)] for i in range(NUM_STREAMS)]
    result = asyncio.run(_streams_while_probing_health(server, prompts))
    assert result.texts == [solo[prompt] for prompt in prompts]
    assert all(reason in ("length", "stop") for reason in result.finish_reasons)
    assert all(status == 200 for status, _, _ in result.probes)
    slowest = max(seconds for _, seconds, _ in result.probes)
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s during the streams"
    during = [p for p in result.probes if p[2] < result.streams_ended]
    assert len(during) >= 3, f"only {len(during)} /health answers came while streaming"
    wait_until_metrics_idle(server.url)


# --- 3. malformed requests -------------------------------------------------------------------

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
    "top_k 0": completion("top_k", "0", top_k=0),
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
        "max_tokens", "1024", max_tokens=MAX_MODEL_LEN, prompt="Hi"
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
    "stop token id outside the vocabulary": completion(None, "stop_token_ids", stop_token_ids=[-1]),
    "user message without content": chat("messages[0].content", messages=[{"role": "user"}]),
    "no API key": Malformed("/v1/completions", COMPLETION, status=401, headers={}),
    "wrong API key": Malformed(
        "/v1/completions", COMPLETION, status=401, headers={"Authorization": "Bearer wrong"}
    ),
}


MALFORMED_CASES = [pytest.param(case, id=name) for name, case in MALFORMED.items()]


@pytest.mark.parametrize("case", MALFORMED_CASES)
def test_malformed_request_gets_its_status_and_an_openai_error(server, case: Malformed):
    url = server.url + case.path
    reply = fetch(case.method, url, body=case.body, raw=case.raw, headers=case.headers)
    assert reply.status == case.status, reply.body
    error = openai_error(reply)
    if case.vllm_sample is not None:
        assert reply.json() == sample(case.vllm_sample)["response"]["body"]
    if case.param is not None:
        assert error["param"] == case.param
    for text in case.mentions or ((case.param,) if case.param else ()):
        assert text in error["message"], error["message"]


def test_a_body_over_the_size_limit_is_a_413(server):
    reply = send_oversized_head(
        server.url,
        "/v1/completions",
        MAX_REQUEST_BODY_BYTES,
        headers=f"Authorization: Bearer {API_KEY}\r\n",
    )
    assert reply.status == 413
    assert str(MAX_REQUEST_BODY_BYTES) in openai_error(reply)["message"]


def test_the_server_serves_normally_after_malformed_requests(server, openai_client):
    with pytest.raises(openai.AuthenticationError):
        client(server.url, "wrong").completions.create(model=MODEL, prompt="Hi")
    result = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0
    )
    assert result.usage.completion_tokens == 2 and result.choices[0].text
    assert server.process.poll() is None
    wait_until_metrics_idle(server.url)  # nothing refused left a request or a KV block behind
    assert "Traceback" not in server.log.read_text(errors="replace")


# --- 4. a client leaving mid-stream ------------------------------------------------------------

LONG_MAX_TOKENS = MAX_MODEL_LEN - 24
"""Far more tokens than the test waits for: the request can only end early by being aborted."""


async def _leave_mid_stream(url: str) -> list[Sample]:
    """Open a long stream, read 3 events, look at /metrics, then drop the connection."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": LONG_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        async with session.post(url + "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status == 200
            events = 0
            while events < 3:
                line = await response.content.readline()
                assert line, "the stream ended early"
                events += line.startswith(b"data: {")
            during = await _read_metrics(session, url)
            response.close()  # closes the connection mid-stream
    return during


def test_a_client_leaving_mid_stream_frees_its_kv_blocks(server):
    before = wait_until_metrics_idle(server.url)
    during = asyncio.run(_leave_mid_stream(server.url))
    assert metric(during, "vllm:num_requests_running") == 1
    assert metric(during, "vllm:kv_cache_usage_perc") > 0
    after = wait_until_metrics_idle(server.url, limit=10)
    # It was aborted, not run to its end.
    assert moved(before, after, "vllm:generation_tokens_total") < LONG_MAX_TOKENS
    success = "vllm:request_success_total"
    assert moved(before, after, success, finished_reason="length") == 0
    assert moved(before, after, success, finished_reason="abort") == 1


# --- 5. /metrics after known requests -----------------------------------------------------------


def test_metrics_counters_move_by_the_known_amounts(server, openai_client, hf_tokenizer):
    # Distinct prompts shorter than one KV block (16 tokens): no prefix cache hit can make
    # the engine compute fewer prompt tokens than the prompts hold.
    requests = [("Counting tokens: the first prompt", 3), ("Rivers flow into the", 5)]
    before = wait_until_metrics_idle(server.url)
    for prompt, max_tokens in requests:
        result = openai_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert result.choices[0].finish_reason == "length"
        assert result.usage.completion_tokens == max_tokens
    after = wait_until_metrics_idle(server.url)
    prompt_tokens = sum(len(hf_tokenizer(prompt).input_ids) for prompt, _ in requests)
    assert moved(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "vllm:generation_tokens_total") == sum(n for _, n in requests)
    success = "vllm:request_success_total"
    assert moved(before, after, success, finished_reason="length") == 2
    assert moved(before, after, success, finished_reason="stop") == 0
    assert moved(before, after, "vllm:request_prompt_tokens_count") == 2
    assert moved(before, after, "vllm:request_prompt_tokens_sum") == prompt_tokens
