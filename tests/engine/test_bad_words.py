"""`bad_words`: the token sequences a word becomes, the bans a matcher applies, and the
default model's greedy output under them against transformers' own NoBadWordsLogitsProcessor
(given the output's tokens only, as vLLM bans over the output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, NoBadWordsLogitsProcessor

from aioserve import LLM, SamplingParams
from aioserve.engine.admission import InvalidRequest
from aioserve.engine.bad_words import BadWordsMatcher, bad_words_token_ids
from tests.engine.smollm2 import hf_model

VOCAB = 64


def allowed(matcher, vocab: int = VOCAB) -> set[int]:
    words = np.zeros(-(-vocab // 32), dtype=np.int32)
    matcher.fill_bitmask(words)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab]
    return {int(t) for t in np.flatnonzero(bits)}


class OnlyTokens:
    """A stand-in structured-output matcher allowing a fixed set of tokens."""

    def __init__(self, tokens: set[int]) -> None:
        self.tokens, self.seen = tokens, []

    def fill_bitmask(self, words: np.ndarray) -> None:
        words.fill(0)
        for t in self.tokens:
            words.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def accept(self, token_id: int) -> bool:
        self.seen.append(token_id)
        return token_id in self.tokens


def test_one_token_words_are_always_banned_longer_ones_after_their_prefix():
    matcher = BadWordsMatcher([[5], [7, 8, 63], [31, 2]])
    assert allowed(matcher) == set(range(VOCAB)) - {5}
    for token in (7, 8):
        assert matcher.accept(token)
    assert allowed(matcher) == set(range(VOCAB)) - {5, 63}  # bit 31 of the second word
    for token, banned in ((1, {5}), (31, {5, 2}), (8, {5})):
        matcher.accept(token)
        assert allowed(matcher) == set(range(VOCAB)) - banned


def test_bans_narrow_a_structured_outputs_mask_and_tokens_reach_it():
    inner = OnlyTokens({2, 5, 9, 10})
    matcher = BadWordsMatcher([[5], [3, 9]], inner)
    assert allowed(matcher) == {2, 9, 10}
    assert not matcher.accept(3)  # the inner matcher's verdict
    assert allowed(matcher) == {2, 10}
    assert inner.seen == [3]


def test_a_word_becomes_its_tokens_with_and_without_a_leading_space(smollm2_gguf):
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for word in ("Paris", "  volcano"):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        expected = [plain] + ([spaced] if len(spaced) == len(plain) else [])
        assert bad_words_token_ids(tokenizer, [word], 49152) == expected
        assert tokenizer.decode(expected[-1]).strip() == word.strip()
    with pytest.raises(InvalidRequest, match="vocabulary size is 100"):
        bad_words_token_ids(tokenizer, ["Paris"], 100)
    with pytest.raises(ValueError, match="cannot contain an empty string"):
        SamplingParams(bad_words=["ok", ""])


@torch.inference_mode()
def hf_greedy_without(gguf_path: str, prompt_ids: list[int], banned: list[list[int]], n: int):
    model = hf_model(gguf_path)
    processor = NoBadWordsLogitsProcessor(banned, eos_token_id=None)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated: list[int] = []
    for _ in range(n):
        logits = processor(torch.tensor([generated], dtype=torch.long), out.logits[:, -1])
        token = int(logits[0].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_output_under_bad_words_is_transformers(smollm2_gguf, async_scheduling):
    """With asynchronous scheduling a step's bans are filled once the step before it has
    returned its tokens (structured_outputs/step_masks.py)."""
    prompt = "The capital of France is"
    with LLM(
        model=str(smollm2_gguf),
        dtype="float32",
        enforce_eager=True,
        async_scheduling=async_scheduling,
    ) as llm:
        tokenizer = llm.get_tokenizer()
        prompt_ids = tokenizer(prompt).input_ids
        free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        (plain,) = llm.generate([{"prompt_token_ids": prompt_ids}], free, use_tqdm=False)
        words = plain.outputs[0].text.split()
        # A word the model says, and two more of its words as one phrase.
        bad = [words[1], " ".join(words[3:5])]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, bad_words=bad)
        (banned,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        sequences = bad_words_token_ids(tokenizer, bad, llm.engine.hf_config.vocab_size)
    assert banned.outputs[0].token_ids != plain.outputs[0].token_ids, "the ban must matter"
    expected = hf_greedy_without(str(smollm2_gguf), prompt_ids, sequences, 24)
    assert list(banned.outputs[0].token_ids) == expected
