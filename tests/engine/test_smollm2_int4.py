"""The default model's Q4_1 layers kept as stored give the dequantized path's greedy tokens.

In bfloat16 on a CPU with bfloat16 arithmetic, a step of up to INT4_MAX_ROWS rows reads the
GGUF's 4-bit weights through torch's int4 op (models/int4_weights.py); one prompt at a time,
every decode step does. The same prompts run on the same engine with the 4-bit weights left
out (the layers' bfloat16 weights only) must give the same tokens. The two products round
differently (bfloat16 scales and zeros against bfloat16 weights), so where a prompt's
tokens part, each path must have scored the other's token within NEAR_TIE_NATS of its own:
two steps of a bfloat16 logit of magnitude 16-32 (0.125 each), plus the int4 product's own
rounding of the same size.
"""

from __future__ import annotations

import pytest
import torch

import aioserve.engine.build as build
from aioserve import LLM, SamplingParams
from aioserve.models.linear import onednn_packs
from tests.engine.smollm2 import NEW_TOKENS, prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not onednn_packs(torch.bfloat16),
        reason="the 4-bit weights are kept only where oneDNN has bfloat16 arithmetic",
    ),
]

NEAR_TIE_NATS = 0.5
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)


def _one_at_a_time(smollm2_gguf, *, int4: bool) -> dict[str, tuple[list[int], list[dict]]]:
    with pytest.MonkeyPatch.context() as patch:
        if not int4:
            patch.setattr(build, "resolve_int4_weights", lambda checkpoint, dtype: False)
        with LLM(model=str(smollm2_gguf), dtype="bfloat16") as engine:
            down_proj = engine.engine.runner.model.layers[0].mlp.down_proj
            assert (down_proj.int4_weight is not None) == int4
            results = {}
            for name, prompt_ids in prompts(engine.get_tokenizer()).items():
                request = [{"prompt_token_ids": prompt_ids}]
                output = engine.generate(request, GREEDY, use_tqdm=False)[0].outputs[0]
                results[name] = (list(output.token_ids), output.logprobs)
            return results


def _gap(logprobs: dict, own: int, other: int) -> float:
    """How far below `own` this step scored `other` (infinite if not in its top two)."""
    if other not in logprobs:
        return float("inf")
    return logprobs[own].logprob - logprobs[other].logprob


def test_kept_quantized_gives_the_dequantized_tokens(smollm2_gguf):
    int4 = _one_at_a_time(smollm2_gguf, int4=True)
    dequantized = _one_at_a_time(smollm2_gguf, int4=False)
    same = 0
    for name, (tokens, logprobs) in int4.items():
        expected, expected_logprobs = dequantized[name]
        if tokens == expected:
            same += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        ours, theirs = tokens[step], expected[step]
        assert _gap(logprobs[step], ours, theirs) <= NEAR_TIE_NATS, name
        assert _gap(expected_logprobs[step], theirs, ours) <= NEAR_TIE_NATS, name
    assert same >= len(int4) // 2, "most prompts must match token for token"
