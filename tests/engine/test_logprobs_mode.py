"""--logprobs-mode end to end on the default model, against transformers' float32 logits over
the same tokens: raw_logits reports the logits themselves (sampled tokens, top n, prompt
tokens); processed_logprobs with temperature and top-k reports the log-softmax of the
scaled logits over the kept tokens, the dropped ones at -inf (logprob_token_ids too), while
prompt tokens, which no sampling processes, keep their raw logprobs (vLLM's semantics). The
mode never changes what is drawn.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from aioserve import SamplingParams
from tests.engine.smollm2 import collect, float32_engine, hf_model

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
TEMPERATURE, TOP_K, SEED = 0.8, 5, 7
ATOL = 2e-3


def _engine(smollm2_gguf, mode: str):
    return float32_engine(smollm2_gguf, 256, logprobs_mode=mode, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def raw_logits(smollm2_gguf):
    engine = _engine(smollm2_gguf, "raw_logits")
    yield engine
    asyncio.run(engine.shutdown())


@pytest.fixture(scope="module")
def processed(smollm2_gguf):
    engine = _engine(smollm2_gguf, "processed_logprobs")
    yield engine
    asyncio.run(engine.shutdown())


@torch.inference_mode()
def hf_logits(smollm2_gguf, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits: row i predicts token i + 1."""
    return hf_model(str(smollm2_gguf))(torch.tensor([token_ids])).logits[0].float()


def run(engine, prompt: list[int], params: SamplingParams, request_id: str):
    outputs = asyncio.run(collect(engine, {"prompt_token_ids": prompt}, params, request_id))
    return outputs[-1]


def test_raw_logits_are_transformers_logits(smollm2_gguf, raw_logits):
    prompt = raw_logits.tokenizer(PROMPT).input_ids
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=5, prompt_logprobs=3)
    output = run(raw_logits, prompt, params, "raw-logits")
    sample = output.outputs[0]
    logits = hf_logits(smollm2_gguf, prompt + sample.token_ids)
    for j, (token, entries) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = logits[len(prompt) - 1 + j]
        top_values, top_ids = row.topk(5)
        assert set(top_ids.tolist()) <= set(entries), j
        for token_id, value in zip(top_ids.tolist(), top_values.tolist(), strict=True):
            assert entries[token_id].logprob == pytest.approx(value, abs=ATOL), (j, token_id)
        assert entries[token].logprob == pytest.approx(row[token].item(), abs=ATOL)
        assert entries[token].rank == 1 + int((row > row[token]).sum())
        # Logits, not logprobs: far from their log-softmax.
        assert entries[token].logprob - torch.log_softmax(row, -1)[token].item() > 1.0
    # Prompt tokens report their logits too.
    for position in range(1, len(prompt)):
        row, token = logits[position - 1], prompt[position]
        entries = output.prompt_logprobs[position]
        assert entries[token].logprob == pytest.approx(row[token].item(), abs=ATOL), position
        assert entries[token].rank == 1 + int((row > row[token]).sum()), position


def _kept(row: torch.Tensor) -> dict[int, float]:
    """token -> processed logprob after temperature and top-k, by the definitions."""
    scaled = row.double() / TEMPERATURE
    values, ids = scaled.topk(TOP_K)
    return dict(zip(ids.tolist(), torch.log_softmax(values, -1).tolist(), strict=True))


def test_processed_logprobs_are_over_the_kept_tokens(smollm2_gguf, processed):
    prompt = processed.tokenizer(PROMPT).input_ids
    params = SamplingParams(
        max_tokens=4, temperature=TEMPERATURE, top_k=TOP_K, seed=SEED, logprobs=8,
        prompt_logprobs=2, ignore_eos=True,
    )  # fmt: skip
    output = run(processed, prompt, params, "processed")
    sample = output.outputs[0]
    logits = hf_logits(smollm2_gguf, prompt + sample.token_ids)
    for j, (token, entries) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        kept = _kept(logits[len(prompt) - 1 + j])
        assert token in kept, j
        assert len(entries) == 8  # the sampled token is among the top 8
        finite = {t: lp.logprob for t, lp in entries.items() if math.isfinite(lp.logprob)}
        assert set(finite) == set(kept), j
        for token_id, value in kept.items():
            assert finite[token_id] == pytest.approx(value, abs=ATOL), (j, token_id)
        assert all(lp.logprob == -math.inf for t, lp in entries.items() if t not in kept)
        assert math.log(sum(math.exp(v) for v in finite.values())) == pytest.approx(0, abs=1e-5)
        assert entries[token].rank == 1 + sum(v > kept[token] for v in kept.values())
    # Prompt tokens go through no sampling: their raw logprobs.
    raw = torch.log_softmax(logits, -1)
    for position in range(1, len(prompt)):
        entries, token = output.prompt_logprobs[position], prompt[position]
        assert entries[token].logprob == pytest.approx(raw[position - 1, token].item(), abs=ATOL)


def test_logprob_token_ids_read_the_processed_logprobs(smollm2_gguf, processed):
    prompt = processed.tokenizer(PROMPT).input_ids
    kept = _kept(hf_logits(smollm2_gguf, prompt)[-1])
    first = max(kept, key=kept.get)
    dropped = 100  # far down the distribution
    assert dropped not in kept
    params = SamplingParams(
        max_tokens=1, temperature=TEMPERATURE, top_k=TOP_K, seed=SEED,
        logprob_token_ids=[first, dropped],
    )  # fmt: skip
    entries = run(processed, prompt, params, "chosen").outputs[0].logprobs[0]
    assert entries[first].logprob == pytest.approx(kept[first], abs=ATOL)
    assert entries[dropped].logprob == -math.inf


def test_the_mode_does_not_change_the_draw(raw_logits, processed):
    prompt = processed.tokenizer(PROMPT).input_ids
    params = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.95, seed=SEED, logprobs=1, ignore_eos=True
    )
    drawn = [
        run(e, prompt, params, f"draw-{i}").outputs[0].token_ids
        for i, e in enumerate((raw_logits, processed))
    ]
    assert drawn[0] == drawn[1]
