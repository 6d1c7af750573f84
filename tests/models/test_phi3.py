"""Phi-3's LongRoPE against transformers: the long factors past the original context, the
engine's choice of factors by the context it serves, and bad factor lists refused. (The
short factors, partial rotary and the tied head are in test_model_parity.py's
"phi3-longrope" config.)"""

from __future__ import annotations

import math

import pytest
import torch

from aioserve.engine.resolution import resolve_max_model_len
from aioserve.kernels.rope_scaling import LONG_FACTORS_KEY, inverse_frequencies
from aioserve.models.registry import model_class_for
from aioserve.models.rope_parameters import choose_longrope_factors, rope_scaling
from tests.models.tiny_models import PagedRunner, hf_and_ours, tiny_phi3_config

ORIGINAL_CONTEXT = 8
SEQUENCE = [5, 17, 200, 3, 9, 41, 77, 120, 6, 250, 11, 13, 90, 4]  # longer than 8


def test_long_factors_match_transformers_past_the_original_context():
    """Served past its original context, every position takes the long factors: as
    transformers does for a whole sequence longer than that context, prompt and decodes."""
    config = tiny_phi3_config(ORIGINAL_CONTEXT)
    choose_longrope_factors(config, max_model_len=4 * ORIGINAL_CONTEXT)
    hf, ours = hf_and_ours(config)
    with torch.no_grad():
        expected = hf(torch.tensor([SEQUENCE])).logits[0]
    runner = PagedRunner(ours)
    prompt = len(SEQUENCE) - 3
    rows = [runner.step([(0, SEQUENCE[:prompt])])]
    rows += [runner.step([(0, [token])]) for token in SEQUENCE[prompt:]]
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=1e-4)
    # The short factors would be off by far more than the tolerance: the test tells the
    # two sets apart.
    _, short = hf_and_ours(tiny_phi3_config(ORIGINAL_CONTEXT))
    short_rows = PagedRunner(short).step([(0, SEQUENCE)])
    assert (short_rows - expected).abs().max() > 1e-3


@pytest.mark.parametrize(("max_model_len", "long"), [(8, False), (9, True), (32, True)])
def test_the_served_context_chooses_the_factors(max_model_len, long):
    config = tiny_phi3_config(ORIGINAL_CONTEXT)
    choose_longrope_factors(config, max_model_len)
    assert rope_scaling(config)[LONG_FACTORS_KEY] is long
    assert rope_scaling(config)["original_max_position_embeddings"] == ORIGINAL_CONTEXT


def test_factors_not_one_per_rotary_pair_are_refused():
    config = tiny_phi3_config(ORIGINAL_CONTEXT)
    rope_scaling(config)["short_factor"] = [1.0] * 5  # 12 rotary dimensions need 6
    with pytest.raises(ValueError, match="short_factor has 5 values.*need 6"):
        model_class_for(config)(config)


def test_the_context_defaults_to_the_original_one_as_in_vllm():
    """Without --max-model-len a LongRoPE model serves its original context (the short
    factors), as vLLM does; asked, it serves up to max_position_embeddings."""
    config = tiny_phi3_config(ORIGINAL_CONTEXT)
    assert resolve_max_model_len(None, config) == ORIGINAL_CONTEXT
    assert resolve_max_model_len(4 * ORIGINAL_CONTEXT, config) == 4 * ORIGINAL_CONTEXT
    with pytest.raises(ValueError, match="larger than the model's maximum context length 32"):
        resolve_max_model_len(4 * ORIGINAL_CONTEXT + 1, config)


@pytest.mark.parametrize("long", [False, True])
def test_a_sets_own_mscale_scales_cos_and_sin(long):
    """Phi-3's first LongRoPE configs give each set its own factor for cos and sin (vLLM
    reads short_mscale / long_mscale); otherwise transformers' default from the stretch."""
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0, 2.0],
        "long_factor": [3.0, 4.0],
        "original_max_position_embeddings": 16,
    }
    _, default = inverse_frequencies(4, 10000.0, scaling, context_length=64)
    assert default == pytest.approx(math.sqrt(1 + math.log(4) / math.log(16)))
    marked = {**scaling, "short_mscale": 1.25, "long_mscale": 1.5, LONG_FACTORS_KEY: long}
    inv_freq, factor = inverse_frequencies(4, 10000.0, marked, context_length=64)
    assert factor == (1.5 if long else 1.25)
    base = 1.0 / 10000.0 ** torch.tensor([0.0, 0.5])
    expected = base / torch.tensor([3.0, 4.0] if long else [1.0, 2.0])
    torch.testing.assert_close(inv_freq, expected)
