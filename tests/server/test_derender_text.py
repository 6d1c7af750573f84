"""derender_text.py: the derender's detokenizer state carried as vLLM's DerenderStreamState
(token strings), and the logprobs' token texts, on SmolLM2's tokenizer (the default
model's GGUF) and a SentencePiece-style one."""

from __future__ import annotations

import json

import pytest

from aioserve.engine.detokenizer import IncrementalDetokenizer
from aioserve.server.derender_text import (
    StreamState,
    chat_logprobs,
    completion_logprobs,
    decode_params,
    detokenize,
    seed_state,
)
from tests.engine.test_detokenizer import TEXTS, _llama_style, encode

CHUNKS = [3, 1, 2, 5, 1, 4]


@pytest.fixture(scope="module", params=["smollm2", "llama"])
def tokenizer(request, smollm2_tokenizer):
    return smollm2_tokenizer if request.param == "smollm2" else _llama_style("llama")


def carried(tokenizer, prompt, output, skip) -> tuple[list[str], StreamState]:
    """Pieces of `output` derendered chunk by chunk, the state sent through JSON between."""
    state = seed_state(tokenizer, prompt, skip)
    pieces, start, step = [], 0, 0
    while start < len(output):
        size = CHUNKS[step % len(CHUNKS)]
        piece, state = detokenize(tokenizer, output[start : start + size], state, skip, True)
        state = StreamState(**json.loads(json.dumps(state.json())))
        pieces.append(piece)
        start, step = start + size, step + 1
    return pieces, state


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", ["prose", "emoji", "cjk", "mixed"])
def test_the_carried_state_decodes_as_one_detokenizer(tokenizer, text, skip):
    prompt = encode(tokenizer, "Answer in one line:")
    output = encode(tokenizer, TEXTS[text]) + [tokenizer.eos_token_id]
    pieces, state = carried(tokenizer, prompt, output, skip)
    whole = IncrementalDetokenizer(tokenizer, prompt[-5:], skip_special_tokens=skip)
    assert "".join(pieces) == whole.add_tokens(output)
    # The window stays short (vLLM's bounded state), and holds no skipped special token.
    assert len(state.prev_tokens) <= 5 and state.prefix_offset == 0
    assert (tokenizer.eos_token in state.prev_tokens) is (not skip)


def test_the_seed_is_vllms(smollm2_tokenizer):
    """The prompt's last seven tokens (special ones dropped when skipped), the last five
    read: vLLM's convert_prompt_ids_to_tokens."""
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    ids = encode(smollm2_tokenizer, text)
    assert ids[-4:-1] == [1, 520, 9531]  # <|im_start|>assistant
    kept = seed_state(smollm2_tokenizer, ids, skip=False)
    assert kept.prev_tokens == smollm2_tokenizer.convert_ids_to_tokens(ids[-7:])
    assert (kept.prefix_offset, kept.read_offset) == (2, 7)
    skipped = seed_state(smollm2_tokenizer, ids, skip=True)
    assert "<|im_start|>" not in skipped.prev_tokens
    specials = sum(token_id in (0, 1, 2) for token_id in ids[-7:])
    assert specials and skipped.read_offset == len(skipped.prev_tokens) == 7 - specials
    assert skipped.prefix_offset == max(7 - specials - 5, 0)
    assert seed_state(smollm2_tokenizer, [], skip=True) == StreamState()


def test_decode_params_are_vllms(smollm2_tokenizer):
    assert decode_params(smollm2_tokenizer, None, None) == (True, True)
    assert decode_params(smollm2_tokenizer, True, False) == (True, True)  # fast: spaced
    assert decode_params(smollm2_tokenizer, False, False) == (False, False)
    assert decode_params(smollm2_tokenizer, True, True, preserve_special=True) == (False, True)


def test_a_character_split_over_tokens_gets_its_text_from_the_tokens_before(smollm2_tokenizer):
    """vLLM's _correct_decoded_token: the emoji's last byte token reads as the emoji, its
    first ones as "" (nothing completes them), and the context runs on across calls."""
    ids = encode(smollm2_tokenizer, " 👋")
    assert len(ids) == 3 and smollm2_tokenizer.decode(ids[:1]).endswith("\ufffd")
    entries = {"content": [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in ids]}
    tokens = [e["token"] for e in chat_logprobs(smollm2_tokenizer, entries)["content"]]
    assert tokens == ["", "", " 👋"]
    last = {"content": [entries["content"][2]]}
    resumed = chat_logprobs(smollm2_tokenizer, last, context_token_ids=ids[:2])["content"][0]
    assert resumed["token"] == " 👋" and resumed["bytes"] == list(" 👋".encode())
    completion = completion_logprobs(chat_logprobs(smollm2_tokenizer, entries), text_offset=4)
    assert completion["text_offset"] == [4, 4, 4] and completion["top_logprobs"] == [None] * 3


def test_a_sentencepiece_token_keeps_its_leading_space():
    """vLLM's decode_token_ids restores the space a Metaspace decode drops."""
    tokenizer = _llama_style("llama")
    ids = encode(tokenizer, "Hello world")
    entries = {"content": [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in ids]}
    tokens = [e["token"] for e in chat_logprobs(tokenizer, entries)["content"]]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    spaced = [i for i, piece in enumerate(pieces) if piece.startswith("\u2581")]
    assert spaced and all(tokens[i].startswith(" ") for i in spaced)
    assert all(tokenizer.decode([ids[i]]).lstrip() == tokens[i].lstrip() for i in spaced)
