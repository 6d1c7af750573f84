"""`logprob_token_ids` over real HTTP, read by the openai client: each position lists the
sampled token, then the chosen ones in their order, their values transformers' log-softmax
on the same weights; the requests vLLM 0.32 refuses get its 400s, naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from aioserve.server.chat_template import render_chat
from aioserve.server.state import ServerState
from tests.engine.smollm2 import hf_model
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post

pytestmark = pytest.mark.slow

CHOSEN = [5, 100, 49151]
MESSAGES = [{"role": "user", "content": "What is the capital of Italy?"}]


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """Raw logprobs [positions, vocab] of a token sequence, by transformers."""
    model = hf_model(str(smollm2_gguf))

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def texts(engine) -> dict[int, str]:
    shown = {t: engine.tokenizer.decode([t]) for t in CHOSEN}
    assert len(set(shown.values())) == len(CHOSEN)  # distinct keys in completions' dicts
    return shown


def test_completions_list_the_sampled_token_then_the_chosen_ones(
    openai_server, engine, reference, texts
):
    prompt = engine.tokenizer("The capital of Italy is").input_ids
    result = client(openai_server).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=3,
        temperature=0,
        logprobs=0,
        extra_body={"logprob_token_ids": CHOSEN, "return_token_ids": True},
    )
    choice = result.choices[0]
    sampled = choice.model_extra["token_ids"]
    expected = reference(prompt + sampled)[len(prompt) - 1 :]
    for position, (token_id, top) in enumerate(
        zip(sampled, choice.logprobs.top_logprobs, strict=True)
    ):
        row = expected[position]
        assert list(top) == [engine.tokenizer.decode([token_id]), *(texts[t] for t in CHOSEN)]
        for t in CHOSEN:
            assert math.isclose(top[texts[t]], float(row[t]), abs_tol=1e-3)
        assert math.isclose(
            choice.logprobs.token_logprobs[position], float(row[token_id]), abs_tol=1e-3
        )


def test_chat_lists_the_sampled_token_then_the_chosen_ones_streamed_or_not(
    openai_server, engine, reference, texts
):
    _, prompt = render_chat(ServerState(engine, [MODEL]), MESSAGES)
    request = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "extra_body": {"logprob_token_ids": CHOSEN, "return_token_ids": True},
    }
    chat = client(openai_server).chat.completions
    choice = chat.create(**request).choices[0]
    sampled, content = choice.model_extra["token_ids"], choice.logprobs.content
    expected = reference(prompt + sampled)[len(prompt) - 1 :]
    for entry, row in zip(content, expected, strict=False):
        listed = entry.top_logprobs
        assert (listed[0].token, listed[0].logprob) == (entry.token, entry.logprob)
        assert [e.token for e in listed[1:]] == [texts[t] for t in CHOSEN]
        for e, t in zip(listed[1:], CHOSEN, strict=True):
            assert math.isclose(e.logprob, float(row[t]), abs_tol=1e-3)
    assert len(content) == len(sampled) == 3
    streamed = [
        entry
        for chunk in chat.create(**request, stream=True)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    # The same tokens; the logprobs within float32's noise (the stream meets the prompt in
    # the prefix cache, and computes less of it).
    assert [[e.token for e in s.top_logprobs] for s in streamed] == [
        [e.token for e in c.top_logprobs] for c in content
    ]
    for s, c in zip(streamed, content, strict=True):
        for a, b in zip(s.top_logprobs, c.top_logprobs, strict=True):
            assert math.isclose(a.logprob, b.logprob, abs_tol=1e-3)


@pytest.mark.parametrize(
    ("route", "fields", "message"),
    [
        (
            "/v1/chat/completions",
            {"logprob_token_ids": [1], "top_logprobs": 2},  # vLLM checks this first
            "when using `logprob_token_ids`, `logprobs` must be set to true. "
            "(parameter=logprob_token_ids)",
        ),
        (
            "/v1/completions",
            {"logprob_token_ids": [1]},
            "when using `logprob_token_ids`, `logprobs` must be set. (parameter=logprob_token_ids)",
        ),
        (
            "/v1/completions",
            {"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0},
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because "
            "no output tokens are generated. (parameter=logprob_token_ids)",
        ),
        (
            "/v1/completions",
            {"logprob_token_ids": [1, 49152, 49153], "logprobs": 0},
            "token_id(s) [49152, 49153] in logprob_token_ids contain out-of-vocab token ids. "
            "Vocabulary size: 49152 (parameter=logprob_token_ids, value=[49152, 49153])",
        ),
        (
            "/v1/chat/completions",
            {"logprob_token_ids": list(range(129)), "logprobs": True},
            "Requested logprob_token_ids of length 129, which is greater than max allowed: 128 "
            "(parameter=logprob_token_ids, value=129)",
        ),
        (
            "/v1/chat/completions",
            {"logprob_token_ids": ["a"], "logprobs": True},
            "logprob_token_ids",
        ),
    ],
)
def test_refused_as_vllm_refuses(openai_server, route, fields, message):
    prompt = {"prompt": "Hello"} if route == "/v1/completions" else {"messages": MESSAGES}
    reply = post(openai_server, route, {"model": MODEL, **prompt, **fields})
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert error["param"] == "logprob_token_ids"
    assert message in error["message"]
