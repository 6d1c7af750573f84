"""End to end: a real `python -m aioserve serve` process, driven over HTTP by the `openai` client.

The server is conftest.py's `server_process` (one per module). The tests reach it only over real
HTTP: the official `openai` client (sync and async) for what users do, raw aiohttp for a
client that leaves mid-stream, and /metrics read with prometheus-client's parser.

References, all independent of the server: transformers' tokenizer loaded from the same
GGUF (prompt token counts, the chat template, the text of the returned token ids), vLLM
0.32's recorded answers on the same model (vllm_samples/), the same request sent alone or
not streamed, and token counts known from the requests themselves.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import openai
import pytest
from prometheus_client.samples import Sample

from tests.server.conftest import MODEL
from tests.server.openai_helpers import sample
from tests.server.serve_process import (
    AUTH,
    MAX_MODEL_LEN,
    TIMEOUT,
    Server,
    async_client,
    metric,
    moved,
    read_metrics_with,
    wait_until_metrics_idle,
)

pytestmark = pytest.mark.slow

# vLLM 0.32's greedy completion and chat requests on this model; it counted 5 and 37
# prompt tokens for them.
VLLM_COMPLETION = sample("04_completion")
VLLM_CHAT = sample("07_chat")
PROMPT = VLLM_COMPLETION["request"]["body"]["prompt"]
QUESTION = VLLM_CHAT["request"]["body"]["messages"]
GREEDY_TOKENS = 12


# --- completions and chat through the openai client ----------------------------------------


@pytest.fixture(scope="module")
def greedy_completion(server_process: Server, server_process_client: openai.OpenAI):
    return server_process_client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=GREEDY_TOKENS,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )


@pytest.fixture(scope="module")
def greedy_chat(server_process: Server, server_process_client: openai.OpenAI):
    return server_process_client.chat.completions.create(
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


def test_streamed_greedy_completion_is_the_full_one(
    server_process, server_process_client, greedy_completion
):
    stream = server_process_client.completions.create(
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


def test_streamed_greedy_chat_is_the_full_one(server_process, server_process_client, greedy_chat):
    stream = server_process_client.chat.completions.create(
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


def test_n2_choices_are_indexed_and_seeded(server_process, server_process_client, hf_tokenizer):
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
    first = server_process_client.completions.create(**request)
    again = server_process_client.completions.create(**request)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    # The prompt counts once, every sample's tokens count.
    assert first.usage.prompt_tokens == len(hf_tokenizer(reference["prompt"]).input_ids)
    assert first.usage.completion_tokens == sum(len(c.token_ids) for c in first.choices)

    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 6}
    chat |= {"temperature": 0.8, "seed": 3, "n": 2}
    full = server_process_client.chat.completions.create(**chat)
    assert [c.index for c in full.choices] == [0, 1]
    streamed = ["", ""]
    for chunk in server_process_client.chat.completions.create(**chat, stream=True):
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
    server_process, server_process_client, greedy_completion, greedy_chat
):
    text = greedy_completion.choices[0].text
    stop = _middle_word(text)
    result = server_process_client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0, stop=[stop]
    )
    (choice,) = result.choices
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop  # vLLM's extra field: which stop string matched

    content = greedy_chat.choices[0].message.content
    stop = _middle_word(content)
    stream = server_process_client.chat.completions.create(
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
    server_process, server_process_client, hf_tokenizer
):
    # A bias of 100 makes the end-of-sequence token the model's only choice.
    forced_eos = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "logit_bias": {str(hf_tokenizer.eos_token_id): 100},
    }
    stopped = server_process_client.completions.create(**forced_eos)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 1
    ignored = server_process_client.completions.create(
        **forced_eos, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 4


def test_a_seed_fixes_the_sampled_text(server_process):
    async def sample_texts(seeds: list[int]) -> list[str]:
        async with async_client(server_process) as seeded_client:
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


# --- many streams at once, and /health meanwhile -----------------------------------------

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


async def _streams_while_probing_health(
    server_process: Server, prompts: list[str]
) -> StreamsAndProbes:
    streams_done = asyncio.Event()
    result = StreamsAndProbes([], [])

    async def probe_health(session: aiohttp.ClientSession) -> None:
        while not streams_done.is_set():
            sent = time.monotonic()
            async with session.get(server_process.url + "/health") as response:
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

    async with (
        async_client(server_process) as streams,
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
    ):
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


def test_64_concurrent_streams_get_their_solo_texts_while_health_answers(
    server_process, server_process_client
):
    solo = {}
    for prompt in CONCURRENT_PROMPTS:
        alone = server_process_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0
        )
        solo[prompt] = alone.choices[0].text
    prompts = [CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)] for i in range(NUM_STREAMS)]
    result = asyncio.run(_streams_while_probing_health(server_process, prompts))
    assert result.texts == [solo[prompt] for prompt in prompts]
    assert all(reason in ("length", "stop") for reason in result.finish_reasons)
    assert all(status == 200 for status, _, _ in result.probes)
    slowest = max(seconds for _, seconds, _ in result.probes)
    assert slowest < HEALTH_BOUND_S, f"/health took {slowest:.2f} s during the streams"
    during = [p for p in result.probes if p[2] < result.streams_ended]
    assert len(during) >= 3, f"only {len(during)} /health answers came while streaming"
    wait_until_metrics_idle(server_process.url)


# --- a client leaving mid-stream ------------------------------------------------------------

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
            during = await read_metrics_with(session, url)
            response.close()  # closes the connection mid-stream
    return during


def test_a_client_leaving_mid_stream_frees_its_kv_blocks(server_process):
    before = wait_until_metrics_idle(server_process.url)
    during = asyncio.run(_leave_mid_stream(server_process.url))
    assert metric(during, "vllm:num_requests_running") == 1
    assert metric(during, "vllm:kv_cache_usage_perc") > 0
    after = wait_until_metrics_idle(server_process.url, limit=10)
    # It was aborted, not run to its end.
    assert moved(before, after, "vllm:generation_tokens_total") < LONG_MAX_TOKENS
    # As vLLM's abort, a request its client left is counted under no finish reason.
    success = "vllm:request_success_total"
    for reason in ("length", "stop", "abort"):
        assert moved(before, after, success, finished_reason=reason) == 0
    assert moved(before, after, "vllm:e2e_request_latency_seconds_count") == 0


# --- /metrics after known requests -----------------------------------------------------------


def test_metrics_counters_move_by_the_known_amounts(
    server_process, server_process_client, hf_tokenizer
):
    # Distinct prompts shorter than one KV block (16 tokens): no prefix cache hit can make
    # the engine compute fewer prompt tokens than the prompts hold.
    requests = [("Counting tokens: the first prompt", 3), ("Rivers flow into the", 5)]
    before = wait_until_metrics_idle(server_process.url)
    for prompt, max_tokens in requests:
        result = server_process_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert result.choices[0].finish_reason == "length"
        assert result.usage.completion_tokens == max_tokens
    after = wait_until_metrics_idle(server_process.url)
    prompt_tokens = sum(len(hf_tokenizer(prompt).input_ids) for prompt, _ in requests)
    assert moved(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "vllm:generation_tokens_total") == sum(n for _, n in requests)
    success = "vllm:request_success_total"
    assert moved(before, after, success, finished_reason="length") == 2
    assert moved(before, after, success, finished_reason="stop") == 0
    assert moved(before, after, "vllm:request_prompt_tokens_count") == 2
    assert moved(before, after, "vllm:request_prompt_tokens_sum") == prompt_tokens
    # Without --speculative-config there are none of vLLM's speculative-decoding series
    # (test_speculative_serving.py has them with it).
    assert [s.name for s in after if s.name.startswith("vllm:spec_decode")] == []
