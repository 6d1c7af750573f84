"""POST /v1/completions over real HTTP, against the official openai client and vLLM's samples.

References: the `openai` client (it parses what we send), vLLM 0.32's recorded answers on
the same model (vllm_samples/: shapes, framing, error bodies, token counts), the model's
tokenizer for prompt lengths, and AsyncEngine.generate called directly for the text.
"""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest

from aioserve.config.frontend import frontend_config
from aioserve.engine.sampling_params import SamplingParams
from tests.server.conftest import MODEL, fail_model_step, wait_until_idle
from tests.server.openai_helpers import (
    TIMEOUT,
    client,
    distinct_shapes,
    post,
    sample,
    sample_stream,
    shape,
    sse_events,
)

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def engine_text(engine, server_loop, prompt, max_tokens: int) -> tuple[str, list[int]]:
    """Greedy text and token ids from the engine itself, without HTTP."""

    async def generate():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        outputs = [o async for o in engine.generate(prompt, params, f"direct-{uuid.uuid4()}")]
        return outputs[-1].outputs[0]

    output = server_loop.run(generate())
    return output.text, output.token_ids


def test_greedy_completion_is_the_engines_text_with_exact_usage(openai_server, engine, server_loop):
    result = client(openai_server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0
    )
    text, token_ids = engine_text(engine, server_loop, PROMPT, 8)
    (choice,) = result.choices
    assert choice.text == text
    assert choice.index == 0
    assert choice.finish_reason == ("length" if len(token_ids) == 8 else "stop")
    assert result.id.startswith("cmpl-")
    assert result.object == "text_completion"
    assert result.model == MODEL
    assert result.usage.prompt_tokens == len(engine.tokenizer(PROMPT).input_ids)
    assert result.usage.completion_tokens == len(token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + len(token_ids)
    wait_until_idle(engine, server_loop)


def test_completion_has_vllms_shape_and_token_counts(openai_server):
    reference = sample("04_completion")
    reply = post(openai_server, "/v1/completions", reference["request"]["body"])
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("application/json")
    body, expected = reply.json(), reference["response"]["body"]
    assert shape(body) == shape(expected)
    # Same model, same tokenizer: vLLM counted 5 prompt tokens and produced 16.
    assert body["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    if body["choices"][0]["finish_reason"] == "length":
        assert body["usage"]["completion_tokens"] == expected["usage"]["completion_tokens"]


def test_n2_with_logprobs_has_vllms_shape(openai_server):
    reference = sample("05_completion_n2_logprobs")
    reply = post(openai_server, "/v1/completions", reference["request"]["body"])
    assert reply.status == 200
    body, expected = reply.json(), reference["response"]["body"]
    assert shape(body) == shape(expected)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"])
        if choice["finish_reason"] == "length":
            assert len(logprobs["tokens"]) == 8
        for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True):
            # The sampled token and the 2 most likely ones (fewer when they coincide).
            assert token in top and 2 <= len(top) <= 3


def test_logprobs_under_greedy_name_the_sampled_token(openai_server):
    result = client(openai_server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    (choice,) = result.choices
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == result.usage.completion_tokens
    offset = 0
    for token, logprob, top, text_offset in zip(
        logprobs.tokens,
        logprobs.token_logprobs,
        logprobs.top_logprobs,
        logprobs.text_offset,
        strict=True,
    ):
        assert max(top, key=top.get) == token
        assert top[token] == logprob <= 0
        assert len(top) == 3
        assert text_offset == offset
        offset += len(token)
    if choice.finish_reason == "length":
        assert "".join(logprobs.tokens) == choice.text


def test_tokens_as_token_ids(start_openai_server):
    url = start_openai_server(frontend=frontend_config(return_tokens_as_token_ids=True))
    body = post(
        url,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
        },
    ).json()
    (choice,) = body["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["prompt_token_ids"] == [504, 3575, 282, 4649, 314]  # the tokenizer's ids


def test_tokens_as_token_ids_per_request_win_over_the_server(openai_server, start_openai_server):
    """vLLM's request field return_tokens_as_token_ids, when set, wins over the flag."""
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}  # fmt: skip
    as_ids = post(openai_server, "/v1/completions", body | {"return_tokens_as_token_ids": True})
    (choice,) = as_ids.json()["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    url = start_openai_server(frontend=frontend_config(return_tokens_as_token_ids=True))
    as_text = post(url, "/v1/completions", body | {"return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in as_text["choices"][0]["logprobs"]["tokens"])
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0,
            "logprobs": True, "return_tokens_as_token_ids": True}  # fmt: skip
    content = post(openai_server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]
    assert all(entry["token"].startswith("token_id:") for entry in content["content"])


def test_stream_is_framed_and_shaped_like_vllms(openai_server):
    reference = sample("04_completion")["request"]["body"]
    expected = sse_events(sample_stream("06_completion_stream"))

    async def stream() -> tuple[int, str, bytes]:
        body = {**reference, "max_tokens": 8, "stream": True}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(f"{openai_server}/v1/completions", json=body) as response:
                return response.status, response.headers["Content-Type"], await response.read()

    status, content_type, raw = asyncio.run(stream())
    assert status == 200
    assert content_type == "text/event-stream; charset=utf-8"
    events = sse_events(raw)
    assert distinct_shapes(events) == distinct_shapes(expected)
    assert len({e["id"] for e in events}) == 1
    whole = post(openai_server, "/v1/completions", {**reference, "max_tokens": 8}).json()
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_stream_usage_chunks(openai_server, engine):
    chunks = list(
        client(openai_server).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    *content, last = chunks
    num_prompt_tokens = len(engine.tokenizer(PROMPT).input_ids)
    assert last.choices == []
    assert last.usage.prompt_tokens == num_prompt_tokens
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens
    assert all(c.usage.prompt_tokens == num_prompt_tokens for c in content)
    assert content[-1].choices[0].finish_reason is not None


def test_continuous_usage_needs_include_usage_and_empty_stream_options_pass(openai_server):
    """vLLM's rules: usage in every chunk only when include_usage asks for usage at all, and
    an empty stream_options on a request that does not stream is no error."""
    chunks = list(
        client(openai_server).completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": False, "continuous_usage_stats": True},
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream_options": {}}
    assert post(openai_server, "/v1/completions", request).status == 200


def test_several_prompts_with_n2_index_choices_like_vllm(openai_server, engine):
    prompts = ["The capital of France is", "One, two, three,"]
    request = {
        "model": MODEL,
        "prompt": prompts,
        "n": 2,
        "max_tokens": 5,
        "temperature": 0.8,
        "seed": 7,
        "echo": True,
        "return_token_ids": True,
    }
    body = post(openai_server, "/v1/completions", request).json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for choice in choices:
        # Choice i*n + j belongs to prompt i: its echoed prompt is that prompt's ids (with
        # return_token_ids, vLLM echoes the ids, not the text).
        prompt_ids = engine.tokenizer(prompts[choice["index"] // 2]).input_ids
        assert choice["prompt_token_ids"] == prompt_ids
    assert body["usage"]["prompt_tokens"] == sum(
        len(engine.tokenizer(p).input_ids) for p in prompts
    )
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)

    # Streamed, the same seeded request gives the same text to the same indices.
    streamed = {i: "" for i in range(4)}
    for chunk in client(openai_server).completions.create(
        **{k: v for k, v in request.items() if k != "return_token_ids"}, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == {c["index"]: prompts[c["index"] // 2] + c["text"] for c in choices}


def test_token_id_prompts_give_the_same_text_as_strings(openai_server, engine):
    prompts = ["The capital of France is", "One, two, three,"]
    ids = [engine.tokenizer(p).input_ids for p in prompts]
    api = client(openai_server)
    by_text = api.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    by_ids = api.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    echoed = api.completions.create(
        model=MODEL, prompt=ids[0], max_tokens=1, temperature=0, echo=True
    )
    assert echoed.choices[0].text.startswith(prompts[0])


def test_stop_string_ends_the_text(openai_server):
    api = client(openai_server)
    base = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = base.choices[0].text
    stop = text.strip().split()[1]  # the second word
    result = api.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop]
    )
    (choice,) = result.choices
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_max_tokens_defaults_to_16(openai_server):
    body = post(
        openai_server, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "ignore_eos": True}
    ).json()
    assert body["usage"]["completion_tokens"] == 16
    assert body["model"] == MODEL  # the first served name when `model` is left out


@pytest.mark.parametrize("name", ["15_err_completion_max_tokens_neg"])
def test_errors_equal_vllms(openai_server, name):
    reference = sample(name)
    reply = post(openai_server, "/v1/completions", reference["request"]["body"])
    assert reply.status == reference["response"]["status"]
    assert reply.json() == reference["response"]["body"]


def test_unknown_model_is_404(openai_server):
    reference = sample("17_err_unknown_model_completion")
    reply = post(openai_server, "/v1/completions", reference["request"]["body"])
    assert reply.status == 404
    error = reply.json()["error"]
    assert shape(error) == shape(reference["response"]["body"]["error"])
    assert error["param"] == "model" and error["type"] == "NotFoundError"
    assert "`no-such-model` does not exist" in error["message"]


def test_prompt_longer_than_the_context_is_400(openai_server, engine):
    prompt = "hello " * 3000
    num_tokens = len(engine.tokenizer(prompt).input_ids)
    reply = post(openai_server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "input_tokens"
    assert error["message"].startswith(
        "This model's maximum context length is 2048 tokens. However, your prompt contains "
        f"{num_tokens} input tokens"
    )


def test_max_tokens_past_the_room_left_is_cut_to_it_and_past_the_context_is_400(
    openai_server, engine
):
    """vLLM 0.32 cuts max_tokens to max_model_len - prompt (api_utils.get_max_tokens) and
    refuses only one past max_model_len itself (renderers/params.py)."""
    prompt = engine.tokenizer("hello " * 3000).input_ids[:2040]
    assert len(prompt) == 2040
    body = {"prompt": prompt, "max_tokens": 2048, "temperature": 0, "ignore_eos": True}
    for path, fields in [("/v1/completions", {}), ("/v1/completions", {"stream": True})]:
        reply = post(openai_server, path, body | fields)
        assert reply.status == 200, reply.body
    answer = post(openai_server, "/v1/completions", body).json()
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["choices"][0]["finish_reason"] == "length"
    # Several prompts: each is cut to its own room.
    both = post(openai_server, "/v1/completions", body | {"prompt": [prompt, prompt[:2030]]})
    assert [c["finish_reason"] for c in both.json()["choices"]] == ["length", "length"]
    assert both.json()["usage"]["completion_tokens"] == 8 + 18
    reply = post(openai_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2049})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "max_tokens"
    assert error["message"].startswith(
        "max_tokens=2049 cannot be greater than max_model_len=2048. Please request fewer "
        "output tokens."
    )


def test_a_null_max_tokens_means_16_as_in_vllm(openai_server):
    body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": None}
    assert post(openai_server, "/v1/completions", body).json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("fields", "param", "shown"),
    [
        ({"max_tokens": "ten"}, "max_tokens", "value=ten"),
        ({"temperature": "hot"}, "temperature", "value=hot"),
        ({"n": 1.5}, "n", "value=1.5"),
        ({"stream": "yes"}, "stream", "value=yes"),
        ({"stop": 5}, "stop", "value=5"),
        ({"stop": [""]}, "stop", "stop cannot contain an empty string"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "abc"),
        ({"logit_bias": {"49152": 1}}, "logit_bias", "value=49152"),
        ({"n": 2, "temperature": 0}, "n", "value=2"),
        ({"top_p": 0}, "top_p", "value=0.0"),
        ({"logprobs": 21}, "logprobs", "value=21"),
        ({"suffix": "!"}, "suffix", "value=!"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream=True"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "value=-1"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "max allowed: 20"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ({"priority": "high"}, "priority", "value=high"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": []}, "prompt", "value=[]"),
        ({"prompt": 5}, "prompt", "value=5"),
        ({"prompt": [[1, "a"]]}, "prompt", 'value=[1,"a"]'),
        ({"prompt": [49152]}, "prompt", "value=49152"),
        ({"prompt": [-1]}, "prompt", "value=-1"),
        ({"prompt": None}, "prompt", "Either prompt or prompt_embeds must be provided"),
        ({"model": 7}, "model", "value=7"),
    ],
)
def test_bad_fields_are_400_naming_field_and_value(openai_server, fields, param, shown):
    reply = post(openai_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **fields})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert shown in error["message"]


@pytest.mark.parametrize(
    "raw", [b'{"prompt": "hi", ', b"[1, 2]", b"", b'"just a string"', b'{"prompt": 1e999}']
)
def test_bodies_that_are_not_json_objects_are_400(openai_server, raw):
    reply = post(openai_server, "/v1/completions", raw=raw)
    assert reply.status == 400
    assert reply.json()["error"]["code"] == 400


def test_draining_server_refuses_with_503(start_openai_server):
    url = start_openai_server(draining=True)
    reply = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert reply.status == 503
    assert reply.json()["error"]["type"] == "ServiceUnavailableError"


LONG_REQUEST = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0}


def test_client_leaving_a_json_request_aborts_it(openai_server, engine, server_loop):
    async def leave_early():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            request = asyncio.ensure_future(
                session.post(f"{openai_server}/v1/completions", json=LONG_REQUEST)
            )
            await _until_running(engine)
            request.cancel()  # closes the connection while the server computes

    asyncio.run(asyncio.wait_for(leave_early(), 60))
    wait_until_idle(engine, server_loop)


def test_client_leaving_a_stream_aborts_it(openai_server, engine, server_loop):
    async def leave_early():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {**LONG_REQUEST, "stream": True}
            async with session.post(f"{openai_server}/v1/completions", json=body) as response:
                first = await response.content.readuntil(b"\n\n")
                response.close()
        return first

    first = asyncio.run(asyncio.wait_for(leave_early(), 60))
    assert first.startswith(b"data: {")
    wait_until_idle(engine, server_loop)


def test_engine_refusal_before_the_stream_starts_is_a_json_error(
    openai_server, engine, server_loop
):
    """A request id already running is refused by the engine itself: still a JSON 400."""

    async def clash():
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            body = {**LONG_REQUEST, "stream": True, "request_id": "same-id"}
            async with session.post(f"{openai_server}/v1/completions", json=body) as first:
                await first.content.readuntil(b"\n\n")
                async with session.post(f"{openai_server}/v1/completions", json=body) as second:
                    result = second.status, second.headers["Content-Type"], await second.json()
                first.close()
        return result

    status, content_type, body = asyncio.run(asyncio.wait_for(clash(), 60))
    assert status == 400
    assert content_type.startswith("application/json")
    assert "already running" in body["error"]["message"]
    wait_until_idle(engine, server_loop)


def test_engine_failure_mid_stream_is_an_error_event(
    openai_server, engine, server_loop, monkeypatch
):
    fail_model_step(monkeypatch, engine, on_call=3)
    reply = post(openai_server, "/v1/completions", {**LONG_REQUEST, "stream": True})
    assert reply.status == 200
    *chunks, error = sse_events(reply.body)
    assert chunks and all("choices" in c for c in chunks)
    assert error["error"]["code"] == 500
    assert "injected step failure" in error["error"]["message"]
    wait_until_idle(engine, server_loop)


async def _until_running(engine, limit: float = 30) -> None:
    """Wait until the engine has a request (a read of a counter owned by another thread)."""
    deadline = asyncio.get_running_loop().time() + limit
    while engine.num_unfinished_requests == 0:
        assert asyncio.get_running_loop().time() < deadline, "the request never reached the engine"
        await asyncio.sleep(0.02)


def test_a_token_whose_text_is_held_back_still_sends_its_chunk(openai_server):
    """vLLM streams a chunk for every step that generated tokens, its text "" while a stop
    string might start there (completion/serving.py); clients time tokens by chunks."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    text = post(openai_server, "/v1/completions", body).json()["choices"][0]["text"]
    held = body | {"stop": [text + " and more"], "stream": True}
    events = sse_events(post(openai_server, "/v1/completions", held).body)
    texts = [event["choices"][0]["text"] for event in events if event != "[DONE]"]
    assert texts[:3] == ["", "", ""] and len(texts) == 4 and "".join(texts) == text


def test_echo_with_token_ids_gives_the_prompts_ids_not_its_text(openai_server):
    """vLLM: with return_token_ids an echo's prompt is its ids, the text the output alone;
    a streamed echo's first chunk carries the prompt's ids even without return_token_ids."""
    body = {"model": MODEL, "prompt": "Hello world", "max_tokens": 2, "temperature": 0,
            "echo": True}  # fmt: skip
    plain = post(openai_server, "/v1/completions", body | {"echo": False}).json()["choices"][0]
    with_ids = post(openai_server, "/v1/completions", body | {"return_token_ids": True}).json()
    (choice,) = with_ids["choices"]
    assert choice["text"] == plain["text"]
    assert choice["prompt_token_ids"] == [19556, 905]  # vLLM's ids (vllm_samples 11)
    shown = [({"return_token_ids": True}, plain["text"]), ({}, "Hello world" + plain["text"])]
    for fields, text in shown:
        events = sse_events(
            post(openai_server, "/v1/completions", body | fields | {"stream": True}).body
        )
        chunks = [event["choices"][0] for event in events if event != "[DONE]"]
        assert chunks[0]["prompt_token_ids"] == [19556, 905]
        assert all(chunk.get("prompt_token_ids") is None for chunk in chunks[1:])
        assert "".join(chunk["text"] for chunk in chunks) == text


def test_an_echoed_prompts_top_logprobs_keep_logprobs_plus_one(openai_server):
    """OpenAI's rule, as vLLM keeps it: at most logprobs + 1 tokens a position, even where
    prompt_logprobs scored the prompt with more."""
    body = {"model": MODEL, "prompt": "Hello world, how are you", "max_tokens": 1,
            "temperature": 0, "echo": True, "logprobs": 1, "prompt_logprobs": 3}  # fmt: skip
    (choice,) = post(openai_server, "/v1/completions", body).json()["choices"]
    tops = choice["logprobs"]["top_logprobs"]
    assert tops[0] is None and all(len(top) <= 2 for top in tops[1:])
    assert any(len(choice["prompt_logprobs"][i]) > 2 for i in range(1, len(tops) - 1))


def test_request_id_and_priority_headers_as_vllm_reads_them(openai_server):
    """vLLM names a request by its X-Request-Id header ahead of the body's request_id, and
    accepts any priority (the fcfs policy ignores it; X-Vllm-Priority may set it)."""

    async def send(headers: dict[str, str], body: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.post(
                openai_server + "/v1/completions", json=body, headers=headers
            ) as response:
                return response.status, await response.json()

    body = {"prompt": PROMPT, "max_tokens": 1, "request_id": "from-body"}
    status, answer = asyncio.run(send({"X-Request-Id": "from-header"}, body))
    assert status == 200 and answer["id"] == "cmpl-from-header"
    status, answer = asyncio.run(send({}, body))
    assert answer["id"] == "cmpl-from-body"
    for headers, fields in [({}, {"priority": 5}), ({"X-Vllm-Priority": "-3"}, {})]:
        status, answer = asyncio.run(send(headers, {"prompt": PROMPT, "max_tokens": 1, **fields}))
        assert status == 200, answer


def test_more_prompts_than_vllms_cap_are_400(openai_server, monkeypatch):
    """vLLM refuses a prompt list over VLLM_MAX_COMPLETION_PROMPTS (1024) before any work."""
    reply = post(openai_server, "/v1/completions", {"prompt": ["a"] * 1025, "max_tokens": 1})
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"].startswith("prompt list length 1025 exceeds the maximum allowed count")
    monkeypatch.setenv("VLLM_MAX_COMPLETION_PROMPTS", "2")
    reply = post(openai_server, "/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert reply.status == 400 and "count of 2" in reply.json()["error"]["message"]
    reply = post(openai_server, "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1})
    assert reply.status == 200
