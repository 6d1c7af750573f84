"""`use_beam_search` over HTTP, with the official `openai` client, on the default model.

The choices are held against beam search written from its definition
(tests/engine/beam_reference.py) over transformers' float32 logits of the same GGUF, run
on the prompt token ids the server reports: the same beams in the same order, vLLM's
finish reasons ("stop" with the EOS id as stop_reason for a beam that ended, "length"
otherwise), texts without the EOS, usage counting every beam. Then vLLM's refusals and
aioserve's, and the pool whole again after each.
"""

from __future__ import annotations

import openai
import pytest

from aioserve.engine.beam_search import BeamSearchParams
from aioserve.engine.sampling_params import SamplingParams
from aioserve.server.beam_search_route import beam_outputs
from tests.engine.beam_reference import reference_beam_search, transformers_logprobs
from tests.engine.smollm2 import hf_model
from tests.server.conftest import MODEL, wait_until_idle
from tests.server.openai_helpers import client, post

pytestmark = pytest.mark.slow

BEAMS = {"use_beam_search": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def next_logprobs(smollm2_gguf):
    return transformers_logprobs(hf_model(str(smollm2_gguf)))


@pytest.fixture(autouse=True)
def idle_after(engine, server_loop):
    yield
    wait_until_idle(engine, server_loop)


def expected_choices(next_logprobs, prompt_ids, width, steps, eos, **fields):
    beams = reference_beam_search(next_logprobs, prompt_ids, width, steps, eos, **fields)
    shown = []
    for beam in beams:
        generated = beam.tokens[len(prompt_ids) :]
        shown.append((generated[:-1] if beam.finished else generated, beam.finished))
    return shown


@pytest.mark.parametrize("length_penalty", [None, 0.5])
def test_completion_beams_are_the_references(
    openai_server, next_logprobs, hf_tokenizer, length_penalty
):
    extra = {**BEAMS} if length_penalty is None else {**BEAMS, "length_penalty": length_penalty}
    reply = client(openai_server).completions.create(
        model=MODEL,
        prompt="The three primary colours are",
        n=3,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body=extra,
    )
    prompt_ids = reply.choices[0].model_extra["prompt_token_ids"]
    eos = hf_tokenizer.eos_token_id
    penalty = {} if length_penalty is None else {"length_penalty": length_penalty}
    expected = expected_choices(next_logprobs, prompt_ids, 3, 6, eos, **penalty)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in reply.choices] == [t for t, _ in expected]
    for choice, (token_ids, finished) in zip(reply.choices, expected, strict=True):
        assert choice.finish_reason == ("stop" if finished else "length")
        assert choice.text == hf_tokenizer.decode(token_ids, skip_special_tokens=True)
        # logprobs=2: each token's logprob and the step's first three entries.
        assert len(choice.logprobs.tokens) == len(token_ids)
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
    generated = sum(len(t) for t, _ in expected)
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(prompt_ids),
        generated,
    )


def test_chat_beams_end_with_eos_as_vllms(openai_server, next_logprobs, hf_tokenizer):
    messages = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    reply = client(openai_server).chat.completions.create(
        model=MODEL, messages=messages, n=3, max_tokens=12, temperature=0, extra_body=BEAMS
    )
    prompt_ids = reply.model_extra["prompt_token_ids"]
    eos = hf_tokenizer.eos_token_id
    expected = expected_choices(next_logprobs, prompt_ids, 3, 12, eos)
    assert any(finished for _, finished in expected)  # EOS is in play here
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice, (token_ids, finished) in zip(reply.choices, expected, strict=True):
        assert choice.model_extra["token_ids"] == token_ids
        assert choice.message.content == hf_tokenizer.decode(token_ids, skip_special_tokens=True)
        if finished:
            assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", eos)
        else:
            assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("length", None)
    # Streamed, each beam comes whole, the same.
    stream = client(openai_server).chat.completions.create(
        model=MODEL,
        messages=messages,
        n=3,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"use_beam_search": True},
    )
    texts, reasons = [""] * 3, [None] * 3
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in reply.choices]
    assert reasons == [c.finish_reason for c in reply.choices]


@pytest.mark.parametrize(
    ("route", "fields", "message", "param"),
    [
        # vLLM 0.32's refusals, in its words.
        ("/v1/completions", {"stream": True}, "Streaming is not currently supported with beam search", None),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [5]}, "`logprob_token_ids` is not supported with beam search. (parameter=logprob_token_ids)", "logprob_token_ids"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "`echo` with `logprobs` is not supported with beam search because beam search does not compute prompt logprobs. (parameter=echo)", "echo"),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [5]}, "`logprob_token_ids` is not supported with beam search. (parameter=logprob_token_ids)", "logprob_token_ids"),
        # aioserve's: what vLLM's beam search would silently do without.
        ("/v1/completions", {"top_p": 0.5}, "top_p is not supported with beam search", "top_p"),
        ("/v1/completions", {"stop": ["."]}, "stop is not supported with beam search", "stop"),
        ("/v1/chat/completions", {"presence_penalty": 1}, "presence_penalty is not supported", "presence_penalty"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format is not supported with beam search", "response_format"),
        ("/v1/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens is not supported", "spaces_between_special_tokens"),
        # Bad values.
        ("/v1/completions", {"use_beam_search": "yes"}, "use_beam_search must be a boolean", "use_beam_search"),
        ("/v1/completions", {"length_penalty": "long"}, "length_penalty must be a number", "length_penalty"),
        ("/v1/completions", {"n": 11}, "Requested sample logprobs of 22, which is greater than max allowed: 20", "n"),
    ],
)  # fmt: skip
def test_refusals(openai_server, route, fields, message, param):
    body = {"model": MODEL, "max_tokens": 2, "n": 2, "use_beam_search": True, **fields}
    body |= {"prompt": "Hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    reply = post(openai_server, route, body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["message"].startswith(message) and error["param"] == param


def test_neutral_values_and_sampling_without_beams_are_left_alone(openai_server):
    api = client(openai_server)
    reply = api.completions.create(
        model=MODEL,
        prompt="Hi",
        n=2,
        max_tokens=3,
        top_p=1.0,
        stop=[],
        extra_body={"use_beam_search": True, "top_k": -1, "min_tokens": 0},
    )
    assert len(reply.choices) == 2
    # Without use_beam_search, length_penalty is ignored as vLLM ignores it.
    reply = api.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"length_penalty": 3.0}
    )
    assert len(reply.choices) == 1
    with pytest.raises(openai.BadRequestError):
        api.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"use_beam_search": True, "top_k": 5}
        )


def test_several_prompts_and_echo(openai_server, hf_tokenizer):
    prompts = ["One, two,", "Red, green,"]
    reply = client(openai_server).completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=3,
        temperature=0,
        echo=True,
        extra_body={"use_beam_search": True},
    )
    # Prompt i's beam j is choice i * n + j, as for samples.
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for k, choice in enumerate(reply.choices):
        assert choice.text.startswith(prompts[k // 2])
    alone = client(openai_server).completions.create(
        model=MODEL, prompt=prompts[1], n=2, max_tokens=3, temperature=0,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert [prompts[1] + c.text for c in alone.choices] == [c.text for c in reply.choices[2:]]
    # echo with max_tokens 0: no step, one beam, the prompt (vLLM's search of 0 tokens).
    echoed = client(openai_server).completions.create(
        model=MODEL, prompt=prompts[0], n=2, max_tokens=0, echo=True,
        extra_body={"use_beam_search": True},
    )  # fmt: skip
    assert [(c.text, c.finish_reason) for c in echoed.choices] == [(prompts[0], "length")]
    assert echoed.usage.completion_tokens == 0


def test_each_step_request_is_traced(engine, server_loop):
    """With --otlp-traces-endpoint, one span per engine request, as vLLM's beam search
    passes the trace headers to each of its requests."""

    class Spans:
        def __init__(self) -> None:
            self.ids: list[str] = []

        def generation_finished(self, request_id, params, output, num_tokens, limit) -> None:
            self.ids.append(request_id)
            assert (params.max_tokens, num_tokens) == (1, 1)

    spans = Spans()
    prompt = {"prompt_token_ids": engine.tokenizer("Once upon a time").input_ids}
    params = SamplingParams(n=1, max_tokens=3, temperature=0)
    beam = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)

    async def run():
        outputs = beam_outputs(engine, prompt, params, "traced", trace=spans, beam=beam)
        return [output async for output in outputs]

    (output,) = server_loop.run(run())
    assert len(output.outputs) == 2
    assert len(spans.ids) == 1 + 2 + 2  # one live beam, then two, at each of 3 steps
    assert len(set(spans.ids)) == len(spans.ids)
