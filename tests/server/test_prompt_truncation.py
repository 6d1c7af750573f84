"""`truncate_prompt_tokens` and `truncation_side` over real HTTP, as vLLM 0.32 applies them.

References: the model's tokenizer loaded apart from the server (`hf_tokenizer`, its
`apply_chat_template` for chats) gives the prompt's tokens, and so the tokens truncation
must keep; the server's answer to those kept tokens sent as the prompt itself gives the
text a truncated request must generate (greedy).
"""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_helpers import post

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog and runs into the forest"
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe, and nothing else."}]
MAX_MODEL_LEN = 2048  # the shared test engine's


def complete(url: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    reply = post(url, "/v1/completions", {**body, **fields})
    assert reply.status == 200, reply.body
    return reply.json()


def refusal(url: str, route: str, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 4, **fields}
    reply = post(url, route, body)
    assert reply.status == 400, reply.body
    return reply.json()["error"]


@pytest.mark.parametrize(("side", "kept"), [(None, slice(-5, None)), ("left", slice(-5, None)),
                                            ("right", slice(0, 5))])  # fmt: skip
def test_a_text_prompt_keeps_five_tokens_from_its_side(openai_server, hf_tokenizer, side, kept):
    ids = hf_tokenizer(PROMPT).input_ids
    assert len(ids) > 5
    fields = {"prompt": PROMPT, "truncate_prompt_tokens": 5}
    if side is not None:
        fields["truncation_side"] = side
    body = complete(openai_server, **fields)
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == ids[kept]
    assert body["usage"]["prompt_tokens"] == 5
    direct = complete(openai_server, prompt=ids[kept])["choices"][0]
    assert choice["token_ids"] == direct["token_ids"]
    # Echo shows the kept prompt's text (without return_token_ids: vLLM then echoes ids).
    echoed = complete(openai_server, **fields, echo=True, return_token_ids=False)["choices"][0]
    assert echoed["text"] == hf_tokenizer.decode(ids[kept]) + direct["text"]


def test_a_token_id_prompt_is_truncated_and_a_short_one_is_kept(openai_server, hf_tokenizer):
    ids = hf_tokenizer(PROMPT).input_ids
    body = complete(openai_server, prompt=ids, truncate_prompt_tokens=3, truncation_side="right")
    assert body["choices"][0]["prompt_token_ids"] == ids[:3]
    body = complete(openai_server, prompt=ids, truncate_prompt_tokens=len(ids) + 100)
    assert body["choices"][0]["prompt_token_ids"] == ids
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_every_prompt_of_a_batch_is_truncated(openai_server, hf_tokenizer):
    prompts = [PROMPT, "Once upon a time in a land far away there lived"]
    body = complete(openai_server, prompt=prompts, truncate_prompt_tokens=4)
    kept = sorted((c["index"], c["prompt_token_ids"]) for c in body["choices"])
    assert kept == [(i, hf_tokenizer(p).input_ids[-4:]) for i, p in enumerate(prompts)]
    assert body["usage"]["prompt_tokens"] == 8


def test_minus_one_keeps_what_the_context_holds_with_room_for_one_token(openai_server):
    too_long = [(i * 37) % 4000 + 100 for i in range(MAX_MODEL_LEN + 50)]
    error = refusal(openai_server, "/v1/completions", prompt=too_long)
    assert "maximum context length" in error["message"]  # without truncation: refused
    body = complete(openai_server, prompt=too_long, truncate_prompt_tokens=-1, max_tokens=1)
    assert body["choices"][0]["prompt_token_ids"] == too_long[-(MAX_MODEL_LEN - 1) :]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (MAX_MODEL_LEN - 1, 1)


def test_a_chat_keeps_the_end_of_its_rendered_prompt(openai_server, hf_tokenizer):
    rendered = hf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    keep = len(rendered) - 6
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    reply = post(
        openai_server,
        "/v1/chat/completions",
        {**body, "truncate_prompt_tokens": keep, "return_token_ids": True},
    )
    assert reply.status == 200, reply.body
    answer = reply.json()
    assert answer["prompt_token_ids"] == rendered[-keep:]
    assert answer["usage"]["prompt_tokens"] == keep
    direct = complete(openai_server, prompt=rendered[-keep:])["choices"][0]
    assert answer["choices"][0]["token_ids"] == direct["token_ids"]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_values_vllm_refuses_are_400s_naming_the_field(openai_server, route):
    prompt = {"prompt": PROMPT} if "chat" not in route else {"messages": MESSAGES}
    error = refusal(openai_server, route, **prompt, truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    assert error["param"] == "truncate_prompt_tokens"
    assert "cannot be greater than max_model_len = 2048" in error["message"]
    error = refusal(openai_server, route, **prompt, truncate_prompt_tokens=-2)
    assert error["param"] == "truncate_prompt_tokens"
    error = refusal(openai_server, route, **prompt, truncate_prompt_tokens=4, truncation_side="mid")
    assert error["param"] == "truncation_side"
    assert error["message"].startswith("`truncation_side` must be either 'left' or 'right'.")
    error = refusal(openai_server, route, **prompt, truncate_prompt_tokens=0)
    assert "empty" in error["message"]  # nothing kept: an empty prompt, refused as such
