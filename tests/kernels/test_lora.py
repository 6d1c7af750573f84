"""Multi-LoRA: the torch reference against a naive per-token float64 loop written from the
adapters' own (unpadded) lora_A and lora_B, the Triton kernels (interpreted on the CPU)
against both, and the token grouping.

Slot ranks below the padded rank R, one to three slices of uneven widths, tokens of several
adapters interleaved with tokens of none; the slot no token uses holds NaNs, so a read of
the wrong slot shows. Under the interpreter the tiles are 16 tokens, 16 columns and ranks,
K in steps of 32, so the shapes reach several token tiles of one group, partial column and
rank tiles, a K tail (48) and whole K steps (64), R 24 (the expand's rank loop with a tail)
and 16. tl.dot on bfloat16 is wrong under the interpreter: the kernels are checked in
float32 and float16 here, bfloat16 on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels import lora as lora_module
from aioserve.kernels.lora import add_lora, add_lora_triton, lora_token_groups
from aioserve.kernels.lora_reference import add_lora_reference

_TOLERANCE = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=4e-2, rtol=3e-2),
}
# Output column bounds of one, two and three slices (q 20, k 8, v 8 the last).
_SLICES = {"one slice": (0, 40), "two slices": (0, 24, 40), "three slices": (0, 20, 28, 36)}
_NUM_SLOTS = 4
_UNUSED_SLOT = 3  # its weights are NaN
_SLOT_RANKS = (8, 16, 5)  # slots 0, 1, 2 (R is 16 or 24)
# Per-token slots (-1: no adapter). "interleaved": slot 1 has 21 tokens (two tiles).
_BATCHES = {
    "interleaved": [1, -1, 0, 1, 2, 1, 1, -1, 0, 2, 1, 1, 0, -1, 1, 1, 2, 1, 0, 1]
    + [1, -1, 1, 1, 2, 0, 1, 1, -1, 1, 1, 2, 1, 1, 0, -1, 1],
    "one adapter, whole batch": [2] * 19,
    "one adapter and tokens without": [-1, 0, 0, -1, 0, 0, 0, -1],
    "one token": [1],
}


def make_layer(
    in_features: int, bounds: tuple[int, ...], rank: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Stacked a [S, n_slices · R, in], b [S, out, R] and, per used slot, each slice's own
    (lora_A [r, in], scaled lora_B [width, r]) in `dtype`, which `a` and `b` hold padded."""
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(bounds) - 1
    a = torch.zeros(_NUM_SLOTS, num_slices * rank, in_features, dtype=dtype)
    b = torch.zeros(_NUM_SLOTS, bounds[-1], rank, dtype=dtype)
    a[_UNUSED_SLOT] = float("nan")
    b[_UNUSED_SLOT] = float("nan")
    adapters = {}
    for slot, r in enumerate(_SLOT_RANKS):
        scaling = 2.0 / r
        slices = []
        for i in range(num_slices):
            width = bounds[i + 1] - bounds[i]
            lora_a = (torch.randn(r, in_features, generator=gen) / in_features**0.5).to(dtype)
            lora_b = (torch.randn(width, r, generator=gen) * scaling).to(dtype)
            a[slot, i * rank : i * rank + r] = lora_a
            b[slot, bounds[i] : bounds[i + 1], :r] = lora_b
            slices.append((lora_a, lora_b))
        adapters[slot] = slices
    return a, b, adapters


def naive(out, x, adapters, bounds, slots) -> torch.Tensor:
    """out + each token's LoRA products, token by token, slice by slice, in float64."""
    expected = out.double().clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for i, (lora_a, lora_b) in enumerate(adapters[slot]):
            xa = lora_a.double() @ x[t].double()
            expected[t, bounds[i] : bounds[i + 1]] += lora_b.double() @ xa
    return expected


def _inputs(num_tokens, in_features, bounds, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    out = torch.randn(num_tokens, bounds[-1], generator=gen).to(dtype)
    return x, out


def _check_against_naive(add, batch, slices, dtype, in_features, rank):
    bounds = _SLICES[slices]
    slots = _BATCHES[batch]
    a, b, adapters = make_layer(in_features, bounds, rank, dtype)
    x, out = _inputs(len(slots), in_features, bounds, dtype)
    groups = lora_token_groups(slots, "cpu")
    result = out.clone()
    add(result, x, a, b, bounds, groups)
    assert result.dtype == dtype
    without = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(result[without], out[without])
    expected = naive(out, x, adapters, bounds, slots)
    torch.testing.assert_close(result.double(), expected, **_TOLERANCE[dtype])
    return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("slices", list(_SLICES))
@pytest.mark.parametrize("batch", list(_BATCHES))
def test_reference_matches_naive(batch, slices, dtype):
    _check_against_naive(add_lora_reference, batch, slices, dtype, 48, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slices", list(_SLICES))
@pytest.mark.parametrize(
    "batch, in_features, rank",
    [("interleaved", 48, 24), ("interleaved", 64, 16), ("one adapter, whole batch", 48, 16)],
)
def test_triton_matches_reference_and_naive(
    triton_backend, batch, slices, dtype, in_features, rank
):
    result = _check_against_naive(add_lora_triton, batch, slices, dtype, in_features, rank)
    bounds = _SLICES[slices]
    a, b, _ = make_layer(in_features, bounds, rank, dtype)
    x, out = _inputs(len(_BATCHES[batch]), in_features, bounds, dtype)
    add_lora_reference(out, x, a, b, bounds, lora_token_groups(_BATCHES[batch], "cpu"))
    torch.testing.assert_close(result, out, **_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_on_strided_views(triton_backend, dtype):
    # x a column slice of a wider activation, out the qkv part of a wider buffer.
    bounds = _SLICES["three slices"]
    slots = _BATCHES["interleaved"]
    a, b, adapters = make_layer(48, bounds, 24, dtype)
    wide_x, wide_out = _inputs(len(slots), 80, (0, 50), dtype)
    x, out = wide_x[:, 16:64], wide_out[:, 7:43]
    before = wide_out.clone()
    add_lora_triton(out, x, a, b, bounds, lora_token_groups(slots, "cpu"))
    expected = naive(before[:, 7:43], x, adapters, bounds, slots)
    torch.testing.assert_close(out.double(), expected, **_TOLERANCE[dtype])
    assert torch.equal(wide_out[:, :7], before[:, :7])
    assert torch.equal(wide_out[:, 43:], before[:, 43:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_gives_a_token_the_same_bits_in_any_batch(triton_backend, dtype):
    # A token's bits whatever the other tokens hold, and alone. Alone it is row 0 of its
    # tile, so the batch's tokens compared are rows 0 of theirs: the interpreter's tl.dot
    # is numpy's, whose float32 GEMM rounds some rows of a 16-row tile otherwise (rows
    # 6-11 at 16 x 32 x 16 here), which a GPU's dot does not.
    bounds = _SLICES["two slices"]
    slots = _BATCHES["interleaved"]
    a, b, _ = make_layer(48, bounds, 24, dtype)
    x, out = _inputs(len(slots), 48, bounds, dtype)
    groups = lora_token_groups(slots, "cpu")
    batched = out.clone()
    add_lora_triton(batched, x, a, b, bounds, groups)
    other_x, other_out = _inputs(len(slots), 48, bounds, dtype, seed=7)
    for t in (0, 22, 36):
        mixed_x, mixed_out = other_x.clone(), other_out.clone()
        mixed_x[t], mixed_out[t] = x[t], out[t]
        add_lora_triton(mixed_out, mixed_x, a, b, bounds, groups)
        assert torch.equal(mixed_out[t], batched[t]), t
    order, starts = groups.token_order.tolist(), groups.group_starts_host
    first_rows = [
        order[i] for g in range(len(starts) - 1) for i in range(starts[g], starts[g + 1], 16)
    ]
    assert len(first_rows) == 4  # slot 1's group has two tiles
    for t in first_rows:
        alone = out[t : t + 1].clone()
        add_lora_triton(alone, x[t : t + 1], a, b, bounds, lora_token_groups([slots[t]], "cpu"))
        assert torch.equal(alone[0], batched[t]), t


def test_the_whole_batch_path_leaves_rows_past_the_groups_alone():
    # Groups of 5 tokens, x and out padded to 8 rows (as a padded batch would be).
    bounds = _SLICES["two slices"]
    a, b, adapters = make_layer(48, bounds, 16, torch.float32)
    x, out = _inputs(8, 48, bounds, torch.float32)
    groups = lora_token_groups([1] * 5, "cpu")
    assert groups.whole_batch_slot == 1
    result = out.clone()
    add_lora_reference(result, x, a, b, bounds, groups)
    assert torch.equal(result[5:], out[5:])
    expected = naive(out[:5], x[:5], adapters, bounds, [1] * 5)
    torch.testing.assert_close(result[:5].double(), expected, **_TOLERANCE[torch.float32])


def test_token_groups():
    groups = lora_token_groups([2, -1, 0, 2, 2, -1, 0, 5], "cpu")
    assert groups.token_order.dtype == torch.int64
    assert groups.group_starts.dtype == groups.group_slots.dtype == torch.int32
    assert groups.token_order.tolist() == [2, 6, 0, 3, 4, 7]  # stable within a slot
    assert groups.group_starts.tolist() == [0, 2, 5, 6]
    assert groups.group_slots.tolist() == [0, 2, 5]
    assert groups.group_starts_host == (0, 2, 5, 6)
    assert groups.group_slots_host == (0, 2, 5)
    assert groups.max_group_tokens == 3
    assert groups.whole_batch_slot is None
    assert lora_token_groups([-1, -1], "cpu") is None
    assert lora_token_groups([], "cpu") is None
    assert lora_token_groups(torch.full((3,), -1), "cpu") is None
    one = lora_token_groups(torch.tensor([3, 3, 3], dtype=torch.int32), "cpu")
    assert one.whole_batch_slot == 3 and one.token_order.tolist() == [0, 1, 2]
    assert one.group_starts_host == (0, 3) and one.max_group_tokens == 3
    assert lora_token_groups([3, 3, -1], "cpu").whole_batch_slot is None


def _refuse(*args, **kwargs):
    raise AssertionError("the other path ran")


def _small_case():
    bounds = _SLICES["two slices"]
    a, b, _ = make_layer(32, bounds, 16, torch.float32)
    x, out = _inputs(3, 32, bounds, torch.float32)
    return out, x, a, b, bounds, lora_token_groups([0, -1, 1], "cpu")


def test_the_cpu_runs_the_reference(monkeypatch):
    out, x, a, b, bounds, groups = _small_case()
    expected = out.clone()
    add_lora_reference(expected, x, a, b, bounds, groups)
    monkeypatch.setattr(lora_module, "add_lora_triton", _refuse)
    add_lora(out, x, a, b, bounds, groups)
    assert torch.equal(out, expected)


def test_the_triton_backend_runs_the_kernels(triton_backend, monkeypatch):
    out, x, a, b, bounds, groups = _small_case()
    expected = out.clone()
    add_lora_triton(expected, x, a, b, bounds, groups)
    monkeypatch.setattr(lora_module, "add_lora_reference", _refuse)
    add_lora(out, x, a, b, bounds, groups)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("add", [add_lora_reference, add_lora_triton])
def test_bad_inputs_are_refused(add):
    out, x, a, b, bounds, groups = _small_case()
    with pytest.raises(ValueError, match="dtype"):
        add(out, x.half(), a, b, bounds, groups)
    with pytest.raises(ValueError, match="slice_bounds"):
        add(out, x, a, b, (0, 24), groups)
    with pytest.raises(ValueError, match="slice_bounds"):
        add(out, x, a, b, (0, 30, 24, 40), groups)
    with pytest.raises(ValueError, match="a must be"):
        add(out, x, a[:, :24], b, bounds, groups)
    with pytest.raises(ValueError, match="b must be"):
        add(out, x, a, b[:2], bounds, groups)
    with pytest.raises(ValueError, match="rows"):
        add(out[:2], x, a, b, bounds, groups)
    with pytest.raises(ValueError, match="want"):
        add(out, x[None], a, b, bounds, groups)


def test_triton_refuses_a_slot_past_the_layers():
    out, x, a, b, bounds, _ = _small_case()
    with pytest.raises(ValueError, match="slot 4"):
        add_lora_triton(out, x, a, b, bounds, lora_token_groups([4], "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 512])
@pytest.mark.parametrize("rank", [16, 64])
def test_gpu_triton_matches_reference(triton_backend, device, dtype, num_tokens, rank):
    # Llama-3-8B's qkv (q 4096, k and v 1024) from hidden 4096, tokens of three adapters
    # and of none interleaved; and each token again alone, for the same bits.
    bounds = (0, 4096, 5120, 6144)
    gen = torch.Generator(device=device).manual_seed(num_tokens + rank)
    a = torch.randn(4, 3 * rank, 4096, generator=gen, device=device).div(64).to(dtype)
    b = torch.randn(4, 6144, rank, generator=gen, device=device).div(rank).to(dtype)
    x = torch.randn(num_tokens, 4096, generator=gen, device=device).to(dtype)
    out = torch.randn(num_tokens, 6144, generator=gen, device=device).to(dtype)
    slots = [(t * 5) % 4 - 1 for t in range(num_tokens)] if num_tokens > 1 else [2]
    groups = lora_token_groups(slots, device)
    result = out.clone()
    add_lora(result, x, a, b, bounds, groups)
    expected = out.clone()
    add_lora_reference(expected, x, a, b, bounds, groups)
    torch.testing.assert_close(result.float(), expected.float(), **_TOLERANCE[dtype])
    with_adapter = [t for t, slot in enumerate(slots) if slot >= 0]
    for t in (with_adapter[0], with_adapter[-1]):
        alone = out[t : t + 1].clone()
        add_lora(alone, x[t : t + 1], a, b, bounds, lora_token_groups([slots[t]], device))
        assert torch.equal(alone[0], result[t])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", sorted(_BATCHES))
def test_reference_takes_float32_weights_beside_16_bit_activations(batch, dtype):
    """The CPU's slots: float32 a and b, a 16-bit x and out, the products in float32."""
    slots = _BATCHES[batch]
    bounds = (0, 40, 56, 72)
    a, b, adapters = make_layer(48, bounds, 24, dtype)
    x, out = _inputs(len(slots), 48, bounds, dtype)
    expected = naive(out, x, adapters, bounds, slots)
    groups = lora_token_groups(slots, "cpu")
    result = out.clone()
    add_lora_reference(result, x, a.float(), b.float(), bounds, groups)
    assert result.dtype == dtype
    torch.testing.assert_close(result.double(), expected, **_TOLERANCE[dtype])
    with pytest.raises(ValueError, match="dtype"):
        add_lora_triton(out.clone(), x, a.float(), b.float(), bounds, groups)
