"""A tiny Llama over an fp8 KV cache on the CPU: its logits against the same model over a
float32 cache, the checkpoint's k_scale/v_scale or scales calculated from the first step,
the pool's dtype and block count."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from aioserve.engine.load_report import build_load_report
from aioserve.kernels.kv_cache import quantize_kv
from aioserve.models.attention_metadata import AttentionMetadata
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.paged_attention_op import K_SCALE_RANGE, V_SCALE_RANGE
from aioserve.models.step_context import step_context
from aioserve.runner.kv_memory import (
    allocate_kv_caches,
    kv_cache_bytes_per_block,
    kv_cache_torch_dtype,
    layer_kv_scales,
    num_kv_blocks,
)
from aioserve.runner.model_runner import ModelRunner
from tests.models.tiny_models import PagedRunner, hf_and_ours, tiny_configs
from tests.runner.test_model_runner import greedy_run

# Logits of the tiny model (random weights, |logits| up to 0.88) over an fp8 cache against
# a float32 one, every step of a prompt and a greedy continuation (the fp8 run fed the
# float run's tokens). Keys and values rounded to 3 mantissa bits (e4m3) or 2 (e5m2) move
# each attention output by a few percent of the values (tests/kernels/test_fp8_kv_cache.py);
# through two layers the largest logit difference seen was 0.026 (e4m3) and 0.046 (e5m2):
# the bounds are three times that.
_LOGIT_ATOL = {"fp8": 0.08, "fp8_e4m3": 0.08, "fp8_e5m2": 0.14}
_PROMPTS = {0: [5, 17, 33, 2, 250, 9, 71, 4, 18], 1: [100, 3, 3, 47, 8]}
_STEPS = 6


def _model(extra_weights: dict[str, torch.Tensor] | None = None):
    config = tiny_configs()["llama-gqa4-llama3-rope"]
    hf, ours = hf_and_ours(config)
    if extra_weights:
        ours.load_weights(extra_weights.items())
    return hf, ours


def _paged(model, kv_dtype: torch.dtype, calculate_scales: bool = False) -> PagedRunner:
    paged = PagedRunner(model, block_size=4, num_blocks=32)
    scales = layer_kv_scales(model, kv_dtype)
    paged.kv, zeroing = allocate_kv_caches(
        model.config, 32, 4, kv_dtype, torch.device("cpu"), scales, calculate_scales
    )
    zeroing.join()
    return paged


def _greedy(paged: PagedRunner, tokens: dict[int, list[int]] | None = None):
    """Logits of each step: both prompts in one step, then decodes of both, each taking
    `tokens` (another run's greedy tokens) or its own greedy token. Returns (logits, tokens)."""
    logits = [paged.step(list(_PROMPTS.items()))]
    ends = [len(_PROMPTS[0]) - 1, len(_PROMPTS[0]) + len(_PROMPTS[1]) - 1]
    last = logits[0][ends]
    chosen = {0: [], 1: []}
    for step in range(_STEPS):
        for seq in (0, 1):
            chosen[seq].append(tokens[seq][step] if tokens else int(last[seq].argmax()))
        logits.append(paged.step([(seq, [chosen[seq][-1]]) for seq in (0, 1)]))
        last = logits[-1]
    return logits, chosen


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_logits_over_fp8_kv_are_within_tolerance_of_float_kv(name):
    _, model = _model()
    reference, tokens = _greedy(_paged(model, torch.float32))
    fp8 = kv_cache_torch_dtype(name, torch.float32)
    paged = _paged(model, fp8)
    assert paged.kv[0][0].dtype == fp8 and float(paged.kv[0].k_scale) == 1.0
    ours, _ = _greedy(paged, tokens)
    for step, (got, expected) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(
            got, expected, atol=_LOGIT_ATOL[name], rtol=0, msg=f"step {step}"
        )
    assert max(float((a - b).abs().max()) for a, b in zip(ours, reference, strict=True)) > 0


def test_checkpoint_scales_are_read_per_layer_and_used():
    scales = {0: (2.0**-3, 2.0**-2), 1: (2.0**-1, 2.0**-4)}
    extra = {}
    for layer, (k, v) in scales.items():
        extra[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        extra[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v])
    _, model = _model(extra)
    assert model.kv_scales.tolist() == [list(scales[0]), list(scales[1])]
    _, plain = _model()
    assert plain.kv_scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]  # none in the checkpoint

    reference = _paged(model, torch.float32)
    reference_logits, tokens = _greedy(reference)
    paged = _paged(model, torch.float8_e4m3fn)
    assert [(float(c.k_scale), float(c.v_scale)) for c in paged.kv] == list(scales.values())
    logits, _ = _greedy(paged, tokens)
    # Layer 0's keys and values are the same in both runs: stored as x / its scales.
    (key, value), (float_key, float_value) = paged.kv[0], reference.kv[0]
    k_scale, v_scale = (torch.tensor([s]) for s in scales[0])
    assert torch.equal(
        key.view(torch.uint8), quantize_kv(float_key, k_scale, key.dtype).view(torch.uint8)
    )
    assert torch.equal(
        value.view(torch.uint8), quantize_kv(float_value, v_scale, value.dtype).view(torch.uint8)
    )
    for got, expected in zip(logits, reference_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=_LOGIT_ATOL["fp8"], rtol=0)


def test_calculated_scales_come_from_the_first_step_that_writes_and_stay():
    # The checkpoint's scales are not taken: vLLM's --calculate-kv-scales computes them.
    _, model = _model({"model.layers.0.self_attn.k_scale": torch.tensor(8.0)})
    reference = _paged(model, torch.float32)
    reference_logits, tokens = _greedy(reference)
    paged = _paged(model, torch.float8_e4m3fn, calculate_scales=True)
    assert all(c.scales_pending and float(c.k_scale) == 1.0 for c in paged.kv)
    # A step that writes no slot (a compile or profiling warm-up) computes nothing.
    with (
        torch.inference_mode(),
        step_context(AttentionMetadata.without_kv_writes(3, torch.device("cpu")), paged.kv),
    ):
        model(torch.tensor([7, 8, 9]), torch.tensor([0, 1, 2]))
    assert all(c.scales_pending and float(c.v_scale) == 1.0 for c in paged.kv)

    logits, _ = _greedy(paged, tokens)
    assert not any(c.scales_pending for c in paged.kv)
    # Layer 0's keys and values of the prompt step are the same in both runs (the float
    # run's cache holds them, zeros elsewhere): the scales are their maxima over 200 and 100.
    (key, value), layer0 = reference.kv[0], paged.kv[0]
    prompt_slots = _prompt_slots(reference)
    assert float(layer0.k_scale) == pytest.approx(
        float(key.flatten(0, 1)[prompt_slots].abs().max()) / K_SCALE_RANGE, rel=1e-6
    )
    assert float(layer0.v_scale) == pytest.approx(
        float(value.flatten(0, 1)[prompt_slots].abs().max()) / V_SCALE_RANGE, rel=1e-6
    )
    for got, expected in zip(logits, reference_logits, strict=True):
        torch.testing.assert_close(got, expected, atol=_LOGIT_ATOL["fp8"], rtol=0)


def test_calculating_scales_needs_an_fp8_cache():
    _, model = _model()
    with pytest.raises(ValueError, match="--calculate-kv-scales needs an fp8 --kv-cache-dtype"):
        allocate_kv_caches(model.config, 4, 4, torch.float32, torch.device("cpu"), None, True)


def _prompt_slots(paged: PagedRunner) -> torch.Tensor:
    """The cache slots the prompt step wrote."""
    slots = []
    for seq, prompt in _PROMPTS.items():
        table, size = paged.tables[seq], paged.block_size
        slots += [table[p // size] * size + p % size for p in range(len(prompt))]
    return torch.tensor(slots)


def test_kv_cache_dtype_names():
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2


def test_an_fp8_pool_holds_twice_the_blocks_of_a_bfloat16_one(tmp_path, monkeypatch):
    hf, model = _model()
    space = 3 * 2**20
    blocks = {
        dtype: num_kv_blocks(
            model,
            block_size=16,
            dtype=dtype,
            num_blocks_override=None,
            cpu_kvcache_space_bytes=space,
            gpu_memory_utilization=0.9,
            max_num_batched_tokens=256,
            max_logits_rows=8,
        )
        for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    }
    per_block = kv_cache_bytes_per_block(model.config, 16, torch.bfloat16)
    assert blocks[torch.bfloat16] == space // per_block
    assert blocks[torch.float8_e4m3fn] == blocks[torch.float8_e5m2] == 2 * blocks[torch.bfloat16]

    # The runner's pool and the ready line's report of it.
    runner = ModelRunner(
        model,
        num_blocks=blocks[torch.float8_e4m3fn],
        block_size=16,
        max_num_seqs=4,
        max_model_len=256,
        dtype=torch.float32,
        device=torch.device("cpu"),
        kv_cache_dtype=torch.float8_e4m3fn,
    )
    runner.warm_up()
    hf.save_pretrained(tmp_path)
    report = build_load_report("tiny", open_checkpoint(str(tmp_path)), runner, "test")
    assert report.kv_cache_bytes == blocks[torch.float8_e4m3fn] * kv_cache_bytes_per_block(
        model.config, 16, torch.float8_e4m3fn
    )
    assert f"(fp8_e4m3, {blocks[torch.float8_e4m3fn]} blocks of 16 tokens)" in report.describe()


def test_compiled_step_over_fp8_kv_gives_the_eager_tokens_with_one_graph_for_every_layer():
    # The CPU's compiled step: each layer's scales are data beside its caches, so the one
    # graph of a decoder layer serves every layer, scales calculated per layer included.
    runners = {}
    for compiled in (False, True):
        _, model = _model()
        runners[compiled] = ModelRunner(
            model,
            num_blocks=64,
            block_size=4,
            max_num_seqs=8,
            max_model_len=256,
            dtype=torch.float32,
            device=torch.device("cpu"),
            compile_model=compiled,
            kv_cache_dtype=torch.float8_e5m2,
            calculate_kv_scales=True,
        )
        runners[compiled].warm_up()
    assert runners[True].model_step.compiled
    counters.clear()
    tokens = greedy_run(runners[True], 4, 6, known=False)
    assert not counters["stats"]["unique_graphs"], dict(counters["stats"])
    assert tokens == greedy_run(runners[False], 4, 6, known=False)
    scales = [(float(c.k_scale), float(c.v_scale)) for c in runners[True].kv_caches]
    eager_scales = [(float(c.k_scale), float(c.v_scale)) for c in runners[False].kv_caches]
    # Layer 1's keys differ in the last bits: inductor sums layer 0 in another order.
    assert scales == [pytest.approx(pair, rel=1e-5) for pair in eager_scales]
    assert len(set(scales)) == len(scales) and (1.0, 1.0) not in scales
