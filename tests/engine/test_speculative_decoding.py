"""Speculative decoding (n-gram lookup) on the default model, end to end: a sequence samples
the tokens it samples without speculation.

Greedy outputs equal transformers' own greedy loop on the same GGUF (float32). Seeded random
sampling, with top-k/top-p/min-p, penalties, min_tokens, logprobs, structured outputs and
bad words, equals the same engine's output without speculation: every position draws with its own token index, and
its penalties count the drafts before it (engine/speculation.py). Each case also checks
that drafts were proposed and kept, so that a speculation silently turned off fails.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from aioserve import LLM, SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from tests.engine.smollm2 import hf_greedy, prompts

pytestmark = pytest.mark.slow

SPECULATION = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
REPEATED = "The quick brown fox jumps over the lazy dog. " * 6
RECORD = {"name": "Ana Maria Lopes", "city": "Lisbon", "pets": ["cat", "dog", "parrot"]}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "city": {"type": "string", "maxLength": 20},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
    },
    "required": ["name", "city", "pets"],
    "additionalProperties": False,
}
# Eager (a speculative step takes the general path, which the compiled one-row graph does
# not), blocks of 16 tokens so that the prompts fill some for the prefix cache.
ENGINE = dict(dtype="float32", enforce_eager=True, block_size=16)


@pytest.fixture(scope="module")
def spec_llm(smollm2_gguf):
    with LLM(model=str(smollm2_gguf), speculative_config=SPECULATION, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain_llm(smollm2_gguf):
    with LLM(model=str(smollm2_gguf), **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompt_ids(spec_llm) -> dict[str, list[int]]:
    tokenizer = spec_llm.get_tokenizer()
    chat = [{"role": "user", "content": CODE + "Rewrite the code above with type hints."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = {name: p for name, p in prompts(tokenizer).items() if name in ("code", "numbers")}
    ids["rewrite"] = tokenizer(text, add_special_tokens=False).input_ids
    ids["repeated"] = tokenizer(REPEATED).input_ids
    copy = f"Copy this JSON exactly: {json.dumps(RECORD)}\nCopy: {json.dumps(RECORD)}\nCopy: "
    ids["json"] = tokenizer(copy).input_ids
    return ids


def _generate(llm: LLM, prompts: list[list[int]], params) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


class _Kept:
    """The drafts the engine proposed and kept while the `with` block ran."""

    def __init__(self, llm: LLM) -> None:
        self.stats = llm.engine.scheduler.stats

    def __enter__(self):
        self.before = (self.stats.num_draft_tokens, self.stats.num_accepted_tokens)
        return self

    def __exit__(self, *exc) -> None:
        self.drafted = self.stats.num_draft_tokens - self.before[0]
        self.accepted = self.stats.num_accepted_tokens - self.before[1]


def test_greedy_equals_transformers(spec_llm, prompt_ids, smollm2_gguf):
    names = list(prompt_ids)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    with _Kept(spec_llm) as kept:
        batched = _generate(spec_llm, [prompt_ids[n] for n in names], params)
    assert kept.accepted > 20 and kept.drafted > kept.accepted
    with _Kept(spec_llm) as kept_alone:
        alone = _generate(spec_llm, [prompt_ids["rewrite"]], params)
    assert kept_alone.accepted > 0
    for name, output in zip(names, batched, strict=True):
        expected = hf_greedy(str(smollm2_gguf), prompt_ids[name])
        assert output.token_ids == expected, f"prompt {name!r} diverges from transformers"
    assert alone[0].token_ids == batched[names.index("rewrite")].token_ids


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=0.8, top_k=40, top_p=0.9),
        dict(temperature=0.7, min_p=0.05),
        dict(temperature=0.6, frequency_penalty=0.4, presence_penalty=0.3),
        dict(temperature=0.0, repetition_penalty=1.05, frequency_penalty=0.05),
    ],
    ids=["top-k-top-p", "min-p", "frequency-presence", "greedy-penalties"],
)
def test_sampling_equals_no_speculation(spec_llm, plain_llm, prompt_ids, settings):
    prompts = [prompt_ids["rewrite"], prompt_ids["repeated"]]
    params = [
        SamplingParams(**settings, seed=seed, max_tokens=48, ignore_eos=True, logprobs=3)
        for seed in (1, 2)
    ]
    with _Kept(spec_llm) as kept:
        got = _generate(spec_llm, prompts, params)
    assert kept.accepted > 0
    expected = _generate(plain_llm, prompts, params)
    for output, reference in zip(got, expected, strict=True):
        assert output.token_ids == reference.token_ids
        assert len(output.logprobs) == len(output.token_ids)
        for position, (mine, theirs) in enumerate(
            zip(output.logprobs, reference.logprobs, strict=False)
        ):
            assert list(mine) == list(theirs), f"top tokens differ at {position}"
            for token_id in mine:
                assert mine[token_id].logprob == pytest.approx(theirs[token_id].logprob, abs=1e-3)


def test_stops_min_tokens_and_max_tokens(spec_llm, plain_llm, prompt_ids):
    prompt = prompt_ids["repeated"]
    cases = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7)
    ] + [
        SamplingParams(temperature=0.0, max_tokens=60, stop=["lazy dog. The"]),
        SamplingParams(temperature=0.0, max_tokens=60, stop_token_ids=[13]),
        SamplingParams(temperature=0.9, seed=5, max_tokens=40, min_tokens=30),
    ]
    with _Kept(spec_llm) as kept:
        got = _generate(spec_llm, [prompt] * len(cases), cases)
    assert kept.accepted > 0
    expected = _generate(plain_llm, [prompt] * len(cases), cases)
    for output, reference, params in zip(got, expected, cases, strict=True):
        assert (output.token_ids, output.text) == (reference.token_ids, reference.text)
        assert output.finish_reason == reference.finish_reason
        assert len(output.token_ids) <= params.max_tokens
    assert [len(o.token_ids) for o in got[:4]] == [1, 2, 3, 7]


def test_the_kv_pool_is_whole_again_and_the_prefix_cache_serves(spec_llm, prompt_ids):
    engine = spec_llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = _generate(spec_llm, [prompt_ids["repeated"]], params)
    hits_before = engine.kv_cache.stats.hits
    again = _generate(spec_llm, [prompt_ids["repeated"]], params)
    assert engine.kv_cache.stats.hits > hits_before
    assert again[0].token_ids == first[0].token_ids
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("backend", ["outlines", "guidance"])
def test_structured_outputs_and_bad_words_draft_and_sample_as_without_speculation(
    spec_llm, plain_llm, prompt_ids, backend
):
    """Constrained sequences with drafts: their masks follow the drafts (step_masks.py), one
    a row after the rows of a free sequence with drafts, and each sample is the one it gets
    without speculation."""
    constraint = Constraint(json=RECORD_SCHEMA, backend=backend)
    cases = [
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
        SamplingParams(temperature=0.8, seed=3, max_tokens=60, structured_outputs=constraint),
        # A ban that bites inside the copied text: the drafts past it are refused.
        SamplingParams(
            temperature=0.0, max_tokens=60, structured_outputs=constraint, bad_words=["dog"]
        ),
        SamplingParams(temperature=0.0, max_tokens=40, bad_words=["lazy"]),
    ]
    prompts = [prompt_ids["repeated"]] + [prompt_ids["json"]] * 3 + [prompt_ids["repeated"]]
    with _Kept(spec_llm) as kept:
        got = _generate(spec_llm, prompts, cases)
    assert kept.accepted > 20 and kept.drafted > kept.accepted
    got = got[1:]
    expected = _generate(plain_llm, prompts[1:], cases[1:])
    for output, reference in zip(got, expected, strict=True):
        assert (output.token_ids, output.finish_reason) == (
            reference.token_ids,
            reference.finish_reason,
        )
    for output in got[:3]:
        jsonschema.validate(json.loads(output.text), RECORD_SCHEMA)
    assert list(json.loads(got[0].text).items()) == list(RECORD.items())  # copied: drafts
    assert "dog" not in got[2].text and "lazy" not in got[3].text
