"""Prompt logprobs over HTTP, as evaluation harnesses ask for them, against transformers'
log-softmax on the same weights: vLLM's `prompt_logprobs` field (completions and chat),
and lm-evaluation-harness's log-likelihood request (echo, logprobs, max_tokens 0 or 1)
through the official `openai` client, streamed and not."""

from __future__ import annotations

import pytest
import torch

from tests.engine.smollm2 import LONG_PASSAGE, hf_prompt_logprobs
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post

pytestmark = pytest.mark.slow

CONTEXT = "The river that runs through the old town floods every spring, and the bakers"
CONTINUATION = " move their ovens upstairs."


def test_completion_prompt_logprobs_match_transformers(openai_server, engine, smollm2_gguf):
    prompt = engine.tokenizer(LONG_PASSAGE).input_ids[:60]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    reply = post(openai_server, "/v1/completions", body)
    assert reply.status == 200, reply.body
    (choice,) = reply.json()["choices"]
    scored = choice["prompt_logprobs"]
    expected = hf_prompt_logprobs(str(smollm2_gguf), prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        entry = scored[position][str(prompt[position])]
        row = expected[position - 1]
        assert entry["logprob"] == pytest.approx(row[prompt[position]].item(), abs=2e-3)
        assert entry["rank"] == 1 + int((row > row[prompt[position]]).sum())
        assert entry["decoded_token"] == engine.tokenizer.decode([prompt[position]])
        assert len(scored[position]) <= 3  # the token and the top 2
    assert choice["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_echo_with_logprobs_scores_the_prompt(
    openai_server, engine, smollm2_gguf, max_tokens, stream
):
    """lm-evaluation-harness's local-completions log-likelihood request."""
    text = CONTEXT + CONTINUATION
    prompt = engine.tokenizer(text).input_ids
    request = {
        "model": MODEL,
        "prompt": text,
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    api = client(openai_server)
    if stream:
        chunks = list(api.completions.create(**request, stream=True))
        text_out = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens, token_logprobs = [], []
        for c in chunks:
            if c.choices and c.choices[0].logprobs is not None:
                tokens += c.choices[0].logprobs.tokens
                token_logprobs += c.choices[0].logprobs.token_logprobs
    else:
        (choice,) = api.completions.create(**request).choices
        text_out = choice.text
        tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
    shown = len(prompt) + max_tokens
    assert len(tokens) == len(token_logprobs) == shown
    assert "".join(tokens[: len(prompt)]) == text
    assert text_out.startswith(text) and (max_tokens or text_out == text)
    assert token_logprobs[0] is None
    expected = hf_prompt_logprobs(str(smollm2_gguf), prompt)
    got = torch.tensor(token_logprobs[1 : len(prompt)])
    want = expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    torch.testing.assert_close(got, want, atol=2e-3, rtol=0)


def test_chat_prompt_logprobs_cover_the_rendered_prompt(openai_server, engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "prompt_logprobs": 0}
    reply = post(openai_server, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    answer = reply.json()
    scored = answer["prompt_logprobs"]
    assert len(scored) == answer["usage"]["prompt_tokens"] and scored[0] is None
    assert all(len(entries) == 1 for entries in scored[1:])
