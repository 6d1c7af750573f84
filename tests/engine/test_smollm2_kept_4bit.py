"""The default model's Q4_1 layers kept as stored give the dequantized path's greedy tokens.

models/gguf_weights.py keeps them two ways: in bfloat16 on a CPU with bfloat16 arithmetic,
a step of up to INT4_MAX_ROWS rows reads them through torch's int4 op (one prompt at a
time, every decode step does); on a GPU the layers hold only their blocks, read by the
Triton kernels. The same prompts run on the same engine without them (the layers'
bfloat16 weights only) must give the same tokens. The products round differently
(bfloat16 scales and zeros, or float32 sums of exact weights, against bfloat16 weights), so
every token both paths chose must have been scored by both within NEAR_TIE_NATS, and where
a prompt's tokens part, each path must have scored the other's token within NEAR_TIE_NATS
of its own: two steps of a bfloat16 logit of magnitude 16-32 (0.125 each), plus the other
product's own rounding of the same size. The logits are bfloat16, so exact ties are common:
how many prompts part depends on the CPU's bfloat16 kernels (2 of 8 on a Xeon with AMX, 5
of 8 on an AVX-512 EPYC, every one at a gap of at most 0.25, the shared tokens' logprobs
within 0.32 of each other), and five logprobs a step show a tie of three.
"""

from __future__ import annotations

import pytest
import torch

import aioserve.engine.served_weights as served_weights
from aioserve import LLM, SamplingParams
from aioserve.models.linear import onednn_packs
from tests.engine.smollm2 import NEW_TOKENS, prompts

pytestmark = pytest.mark.slow

NEAR_TIE_NATS = 0.5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def _one_at_a_time(smollm2_gguf, *, kept: bool) -> dict[str, tuple[list[int], list[dict]]]:
    with pytest.MonkeyPatch.context() as patch:
        if not kept:
            patch.setattr(served_weights, "resolve_int4_weights", lambda checkpoint, dtype: False)
            patch.setattr(served_weights, "resolve_gguf_blocks", lambda checkpoint: False)
        with LLM(model=str(smollm2_gguf), dtype="bfloat16") as engine:
            down_proj = engine.engine.runner.model.layers[0].mlp.down_proj
            held = (down_proj.int4_weight, down_proj.gguf_blocks)
            assert any(tensor is not None for tensor in held) == kept
            results = {}
            for name, prompt_ids in prompts(engine.get_tokenizer()).items():
                request = [{"prompt_token_ids": prompt_ids}]
                output = engine.generate(request, GREEDY, use_tqdm=False)[0].outputs[0]
                results[name] = (list(output.token_ids), output.logprobs)
            return results


def _gap(logprobs: dict, own: int, other: int) -> float:
    """How far below `own` this step scored `other` (infinite if not in its top five)."""
    if other not in logprobs:
        return float("inf")
    return logprobs[own].logprob - logprobs[other].logprob


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16),
    reason="the CPU keeps the 4-bit weights only where oneDNN has bfloat16 arithmetic",
)
def test_the_cpus_int4_weights_give_the_dequantized_tokens(smollm2_gguf):
    _assert_same_tokens_but_near_ties(smollm2_gguf)


@pytest.mark.gpu
def test_the_gpus_kept_blocks_give_the_dequantized_tokens(smollm2_gguf):
    _assert_same_tokens_but_near_ties(smollm2_gguf)


def _assert_same_tokens_but_near_ties(smollm2_gguf) -> None:
    kept = _one_at_a_time(smollm2_gguf, kept=True)
    dequantized = _one_at_a_time(smollm2_gguf, kept=False)
    for name, (tokens, logprobs) in kept.items():
        expected, expected_logprobs = dequantized[name]
        shared = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b),
            len(tokens),
        )
        for step in range(shared):
            token = tokens[step]
            difference = logprobs[step][token].logprob - expected_logprobs[step][token].logprob
            assert abs(difference) <= NEAR_TIE_NATS, (name, step)
        if shared < len(tokens):
            ours, theirs = tokens[shared], expected[shared]
            assert _gap(logprobs[shared], ours, theirs) <= NEAR_TIE_NATS, name
            assert _gap(expected_logprobs[shared], theirs, ours) <= NEAR_TIE_NATS, name
