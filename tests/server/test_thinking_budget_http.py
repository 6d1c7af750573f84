"""thinking_token_budget over real HTTP (the official openai client) with --reasoning-parser
deepseek_r1: a completion whose prompt opens a thought gets `</think>` after the budget's
tokens, a chat answer continuing an open thought splits there into reasoning and content,
Anthropic's thinking budget reaches it, and bad budgets are 400s naming the field. One
SmolLM2 engine (float32, eager) for the module."""

from __future__ import annotations

import pytest

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post

PROMPT = "Question: which is larger, 9.11 or 9.9? Think first.\n<think>"


@pytest.fixture(scope="module")
def url(smollm2_gguf, server_loop):
    engine = float32_engine(
        smollm2_gguf,
        max_model_len=2048,
        num_gpu_blocks_override=160,
        reasoning_parser="deepseek_r1",
    )
    try:
        with serve_app(server_loop, openai_app(ServerState(engine, [MODEL]))) as base:
            yield base
    finally:
        server_loop.run(engine.shutdown())


@pytest.fixture(scope="module")
def end_ids(hf_tokenizer) -> list[int]:
    return hf_tokenizer.encode("</think>", add_special_tokens=False)


def _complete(url: str, **more) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
    reply = post(url, "/v1/completions", {**body, "return_token_ids": True, **more})
    assert reply.status == 200, reply.body
    return reply.json()["choices"][0]


def test_a_completion_thinks_its_budget_then_gets_the_end_marker(url, end_ids, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode(PROMPT, add_special_tokens=False)
    think = hf_tokenizer.encode("<think>", add_special_tokens=False)
    assert prompt_ids[-len(think) :] == think  # the prompt opens a thought
    free = _complete(url)
    cut = _complete(url, thinking_token_budget=4)
    assert cut["token_ids"][:4] == free["token_ids"][:4]
    assert (
        cut["token_ids"][4 : 4 + len(end_ids)] == end_ids != free["token_ids"][4 : 4 + len(end_ids)]
    )
    assert "</think>" in cut["text"] and "</think>" not in free["text"]
    assert _complete(url, thinking_token_budget=-1) == free  # vLLM's "unlimited"
    streamed = client(url).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.0,
        stream=True,
        extra_body={"thinking_token_budget": 4},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed) == cut["text"]


def test_a_chat_answer_continuing_an_open_thought_splits_at_the_forced_end(url):
    answer = client(url).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Which is larger, 9.11 or 9.9?"},
            {"role": "assistant", "content": "<think>\n"},
        ],
        max_tokens=24,
        temperature=0.0,
        extra_body={
            "thinking_token_budget": 6,
            "ignore_eos": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    message = answer.choices[0].message
    reasoning = getattr(message, "reasoning", None) or message.model_extra.get("reasoning")
    # The prompt's "\n" and five tokens of thought, then `</think>` and the answer.
    assert reasoning == "\nThe answer is " and message.content
    assert answer.usage.completion_tokens == 24


def test_anthropics_thinking_budget_becomes_the_thinking_token_budget(url):
    reply = post(
        url,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 1100,
            "messages": [{"role": "user", "content": "Hi"}],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stop_sequences": ["\n"],
        },
    )
    assert reply.status == 200, reply.body


@pytest.mark.parametrize("budget", [-2, 1.5, True, "4"])
def test_a_bad_budget_is_a_400_naming_the_field(url, budget):
    reply = post(
        url,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "thinking_token_budget": budget},
    )
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["param"] == "thinking_token_budget"
