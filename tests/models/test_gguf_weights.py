"""GGUF quantized weights kept as stored (models/gguf_weights.py, kernels/gguf_linear_reference.py)
against the float32 product of the weights dequantized.

The reference form of every type (`unpack_codes`, `dequantize_blocks`) is gguf-py's
dequantization exactly (bit for bit, no tolerance): on blocks gguf-py's quantizer wrote for
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, on random blocks built byte by byte in ggml's layout for
the k-quants, which gguf-py cannot quantize.

The CPU's int4 copy:

- `unpack_blocks` reads what gguf-py's quantizer wrote: its dequantization, exactly;
- `int4_linear` on `pack_int4`'s layout equals the float32 product within bfloat16's rounding
  of the scales, zeros and output (relative error under 1%; a wrong nibble order or group
  gives ~100%);
- a tiny Qwen2 GGUF with Q4_0/Q4_1 layers and one Q8_0 shard: exactly the Linears whose
  shards are all 4-bit get int4 weights, each reproducing the loader's dequantized weights;
- `dense` on packed weights reads the int4 ones up to INT4_MAX_ROWS rows and oneDNN's from
  there on (where this CPU has bfloat16 arithmetic).

The GPU's blocks in place of the weights (`keep_gguf_blocks`), run here on the CPU:
- exactly the Linears whose shards are all of one type the kernels read keep the blocks and
  release their float weights, and compute what the float weights computed, through the
  torch reference and through the Triton kernels (interpreted): the Q4_0/Q4_1 model above,
  and a 256-wide one (a k-quant super-block is 256 weights) mixing Q5_0, Q5_1, Q8_0, Q4_K,
  Q5_K, Q6_K and F16, whose 4-bit-free layers get no int4 copy;
- tiny models holding them give the dequantized model's greedy tokens over a prefill
  and decodes (a ModelRunner, float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from aioserve.kernels.gguf_linear_reference import (
    CODE_OFFSET,
    GGUF_TYPES,
    SCALE_GROUP,
    dequantize_blocks,
    dequantize_codes,
    gguf_linear_reference,
    int4_linear,
    pack_int4,
    unpack_blocks,
    unpack_codes,
)
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.gguf_weights import keep_gguf_blocks, keep_int4_weights
from aioserve.models.linear import INT4_MAX_ROWS, Linear, dense, onednn_packs, pack_weights
from aioserve.models.loader import load_model
from aioserve.models.loaders.gguf import QType
from aioserve.runner.model_runner import ModelRunner
from tests.models.tiny_gguf import K_QUANTS, random_blocks, tiny_state_dict, write_tiny_gguf
from tests.runner.plans import PlanMaker, run_step

TYPES = {"q4_0": QType.Q4_0, "q4_1": QType.Q4_1}


def _blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """gguf-py's quantization of random weights: (blocks as a torch tensor, their values)."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf_quantize(values, TYPES[qtype]).view(np.uint8)
    return torch.from_numpy(raw.copy()), gguf_dequantize(raw, TYPES[qtype])


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("qtype", TYPES)
def test_unpacked_blocks_are_gguf_pys_weights(qtype):
    blocks, expected = _blocks(qtype, rows=5, cols=96)
    codes, scale, zero = unpack_blocks(blocks, qtype)
    assert codes.shape == (5, 96) and scale.shape == zero.shape == (5, 3)
    assert int(codes.max()) <= 15
    weights = dequantize_codes(codes, scale, zero)
    torch.testing.assert_close(weights, torch.from_numpy(expected), rtol=0, atol=0)


# the largest code of each type: 4, 5, 8 or 6 bits
_CODE_BITS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q8_0": 8, "q4_k": 4, "q5_k": 5}


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_unpacked_codes_are_gguf_pys_weights(qtype):
    ggml_type = QType[qtype.upper()]
    if ggml_type in K_QUANTS:
        raw = random_blocks(3, 512, ggml_type, seed=7)
    else:
        values = np.random.default_rng(7).standard_normal((3, 96)).astype(np.float32)
        raw = gguf_quantize(values, ggml_type).view(np.uint8)
    expected = torch.from_numpy(gguf_dequantize(raw, ggml_type))
    blocks = torch.from_numpy(raw.copy())
    codes, scale, zero = unpack_codes(blocks, qtype)
    group = SCALE_GROUP.get(qtype, 32)
    assert codes.shape == expected.shape and codes.dtype == torch.uint8
    assert scale.shape == zero.shape == (3, expected.shape[1] // group)
    assert int(codes.max()) < 2 ** _CODE_BITS.get(qtype, 6)
    if qtype not in ("q4_1", "q5_1", "q4_k", "q5_k"):
        assert not zero.any() and CODE_OFFSET[qtype] > 0  # w = (q - offset) * scale
    torch.testing.assert_close(dequantize_blocks(blocks, qtype), expected, rtol=0, atol=0)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_product_matches_the_float_product(qtype, rows):
    blocks, _ = _blocks(qtype, rows=80, cols=160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(80).bfloat16()
    packed, scales_and_zeros = pack_int4(*unpack_blocks(blocks, qtype))
    got = int4_linear(x, packed, scales_and_zeros, bias)
    expected = gguf_linear_reference(x.float(), blocks, qtype, bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    assert _relative_error(got, expected) < 1e-2


def test_shapes_outside_the_int4_layout_are_refused():
    for rows, cols in ((16, 48), (24, 64)):
        codes = torch.zeros(rows, cols, dtype=torch.uint8)
        with pytest.raises(ValueError, match="does not fit torch's int4 layout"):
            pack_int4(codes, torch.ones(rows, 2), torch.zeros(rows, 2))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer qwen2 (q/k/v biases) whose layers are 4-bit, but for one Q8_0 up_proj."""
    path = tmp_path_factory.mktemp("int4") / "tiny-q4.gguf"
    quantized = {  # the first suffix that matches decides
        "layers.1.mlp.up_proj.weight": QType.Q8_0,
        "q_proj.weight": QType.Q4_0,
        "k_proj.weight": QType.Q4_1,
        "v_proj.weight": QType.Q4_1,
        "o_proj.weight": QType.Q4_0,
        "gate_proj.weight": QType.Q4_1,
        "up_proj.weight": QType.Q4_1,
        "down_proj.weight": QType.Q4_1,  # rows of 96: three blocks of 32
    }
    write_tiny_gguf(path, "qwen2", tiny_state_dict("qwen2"), quantized)
    return path


def test_the_4bit_layers_get_int4_weights_equal_to_the_dequantized_ones(tiny_gguf):
    checkpoint = open_checkpoint(str(tiny_gguf))
    model = load_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"), use_tqdm=False)
    added = keep_int4_weights(model, checkpoint, torch.bfloat16)

    with_int4 = {
        name
        for name, m in model.named_modules()
        if isinstance(m, Linear) and m.int4_weight is not None
    }
    expected = {
        f"layers.{layer}.{part}"
        for layer in (0, 1)
        for part in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.down_proj")
    } | {"layers.0.mlp.gate_up_proj"}  # layer 1's up_proj shard is Q8_0
    assert with_int4 == expected
    assert added == sum(
        m.int4_weight.nbytes + m.int4_scales_and_zeros.nbytes
        for m in model.modules()
        if isinstance(m, Linear) and m.int4_weight is not None
    )

    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).bfloat16()
    for name in sorted(with_int4):
        module = model.get_submodule(name)
        inputs = x[:, : module.in_features]
        got = int4_linear(inputs, module.int4_weight, module.int4_scales_and_zeros)
        reference = inputs.float() @ module.weight.t()  # the loader's dequantized float32
        assert _relative_error(got, reference) < 1e-2, name


@pytest.mark.skipif(
    not onednn_packs(torch.bfloat16), reason="this CPU has no bfloat16 arithmetic for oneDNN"
)
def test_dense_reads_int4_weights_for_small_steps_only(tiny_gguf):
    checkpoint = open_checkpoint(str(tiny_gguf))
    model = load_model(checkpoint, dtype=torch.bfloat16, device=torch.device("cpu"), use_tqdm=False)
    keep_int4_weights(model, checkpoint, torch.bfloat16)
    pack_weights(model)
    layer = model.get_submodule("layers.0.mlp.down_proj")
    x = torch.randn(INT4_MAX_ROWS + 1, 96).bfloat16()
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1):
        got = layer(x[:rows])
        int4 = int4_linear(x[:rows], layer.int4_weight, layer.int4_scales_and_zeros)
        packed = dense(x[:rows], layer.weight, packed_weight=layer.packed_weight)
        assert not torch.equal(int4, packed)  # the two products differ in their last bits
        assert torch.equal(got, int4 if rows <= INT4_MAX_ROWS else packed), rows


def _float_model(path, **options):
    return load_model(
        open_checkpoint(str(path)), dtype=torch.float32, device=torch.device("cpu"), **options
    )


def test_layers_of_one_4bit_type_keep_their_blocks_in_place_of_the_weights(tiny_gguf):
    checkpoint = open_checkpoint(str(tiny_gguf))
    model = _float_model(tiny_gguf, use_tqdm=False)
    dequantized = {
        name: m.weight.clone() for name, m in model.named_modules() if isinstance(m, Linear)
    }
    kept_bytes = keep_gguf_blocks(model, checkpoint)

    kept = {
        n for n, m in model.named_modules() if isinstance(m, Linear) and m.gguf_blocks is not None
    }
    # q_proj is Q4_0 and k/v Q4_1: two types in one stacked layer; layer 1's up_proj is Q8_0
    assert kept == {
        "layers.0.self_attn.o_proj",
        "layers.1.self_attn.o_proj",
        "layers.0.mlp.down_proj",
        "layers.1.mlp.down_proj",
        "layers.0.mlp.gate_up_proj",
    }
    assert kept_bytes == sum(model.get_submodule(n).gguf_blocks.nbytes for n in kept)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    for name in sorted(kept):
        module = model.get_submodule(name)
        assert module.weight.stride() == (0, 0) and module.weight.shape == dequantized[name].shape
        assert module.gguf_qtype == ("q4_0" if name.endswith("o_proj") else "q4_1")
        inputs = x[:, : module.in_features]
        torch.testing.assert_close(
            module(inputs), inputs @ dequantized[name].t(), rtol=1e-5, atol=1e-5
        )


def test_the_triton_kernels_compute_a_kept_layer(tiny_gguf, triton_backend):
    model = _float_model(tiny_gguf, use_tqdm=False)
    keep_gguf_blocks(model, open_checkpoint(str(tiny_gguf)))
    layer = model.get_submodule("layers.0.mlp.gate_up_proj")
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    expected = gguf_linear_reference(x, layer.gguf_blocks, "q4_1")
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def _greedy_tokens(model, steps: int = 6) -> list[int]:
    runner = ModelRunner(
        model,
        num_blocks=16,
        block_size=4,
        max_num_seqs=2,
        max_model_len=64,
        dtype=torch.float32,
        device=torch.device("cpu"),
        compile_model=False,
    )
    maker = PlanMaker(block_size=4, num_blocks=16)
    maker.admit("a", [5, 17, 3, 9, 30, 12, 8])
    tokens: list[int] = []
    result = run_step(runner, maker.plan([("a", 7)]))
    for _ in range(steps):
        tokens += result.sampled["a"]
        maker.learn(result.sampled)
        result = run_step(runner, maker.plan([("a", 1)]))
    return tokens + result.sampled["a"]


def test_a_model_keeping_blocks_gives_the_dequantized_models_tokens(tiny_gguf):
    kept = _float_model(tiny_gguf, use_tqdm=False)
    assert keep_gguf_blocks(kept, open_checkpoint(str(tiny_gguf))) > 0
    assert _greedy_tokens(kept) == _greedy_tokens(_float_model(tiny_gguf, use_tqdm=False))


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory):
    """A 2-layer qwen2 256 wide (a k-quant super-block) whose Linears mix the other types."""
    path = tmp_path_factory.mktemp("gguf-types") / "tiny-mixed.gguf"
    quantized = {
        "layers.0.self_attn.q_proj.weight": QType.Q4_K,
        "layers.0.self_attn.k_proj.weight": QType.Q4_K,
        "layers.0.self_attn.v_proj.weight": QType.Q6_K,  # as a Q4_K_M file mixes them
        "layers.1.self_attn.q_proj.weight": QType.Q5_K,
        "layers.1.self_attn.k_proj.weight": QType.Q5_K,
        "layers.1.self_attn.v_proj.weight": QType.Q5_K,
        "layers.0.self_attn.o_proj.weight": QType.Q6_K,
        "layers.1.self_attn.o_proj.weight": QType.Q8_0,
        "layers.0.mlp.gate_proj.weight": QType.Q5_0,
        "layers.0.mlp.up_proj.weight": QType.Q5_0,
        "layers.1.mlp.gate_proj.weight": QType.Q5_1,
        "layers.1.mlp.up_proj.weight": QType.Q5_1,
        "layers.0.mlp.down_proj.weight": QType.Q4_K,
        "layers.1.mlp.down_proj.weight": QType.F16,  # not a block type
    }
    state = tiny_state_dict("qwen2", hidden=256, head_dim=64, ffn=256)
    write_tiny_gguf(path, "qwen2", state, quantized)
    return path


_WIDE_KEPT = {
    "layers.1.self_attn.qkv_proj": "q5_k",
    "layers.0.self_attn.o_proj": "q6_k",
    "layers.1.self_attn.o_proj": "q8_0",
    "layers.0.mlp.gate_up_proj": "q5_0",
    "layers.1.mlp.gate_up_proj": "q5_1",
    "layers.0.mlp.down_proj": "q4_k",
}


def test_layers_of_one_type_of_any_kind_keep_their_blocks(wide_gguf):
    checkpoint = open_checkpoint(str(wide_gguf))
    model = _float_model(wide_gguf, use_tqdm=False)
    dequantized = {
        name: m.weight.clone() for name, m in model.named_modules() if isinstance(m, Linear)
    }
    assert keep_int4_weights(model, checkpoint, torch.bfloat16) == 0  # no 4-bit layer
    kept_bytes = keep_gguf_blocks(model, checkpoint)

    kept = {
        n: m.gguf_qtype
        for n, m in model.named_modules()
        if isinstance(m, Linear) and m.gguf_blocks is not None
    }
    # layer 0's q/k are Q4_K and its v Q6_K; layer 1's down_proj is F16
    assert kept == _WIDE_KEPT
    assert kept_bytes == sum(model.get_submodule(n).gguf_blocks.nbytes for n in kept)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for name in sorted(kept):
        module = model.get_submodule(name)
        assert module.weight.stride() == (0, 0) and module.weight.shape == dequantized[name].shape
        # the reference against the loader's own dequantization (loaders/gguf.py)
        expected = torch.nn.functional.linear(x, dequantized[name], module.bias)
        torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["layers.0.mlp.down_proj", "layers.0.self_attn.o_proj"])
def test_the_triton_kernels_compute_a_kept_k_quant_layer(wide_gguf, triton_backend, name):
    model = _float_model(wide_gguf, use_tqdm=False)
    layer = model.get_submodule(name)
    weight = layer.weight.clone()
    keep_gguf_blocks(model, open_checkpoint(str(wide_gguf)))
    assert layer.gguf_qtype in ("q4_k", "q6_k")
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_a_model_keeping_blocks_of_every_type_gives_the_dequantized_models_tokens(wide_gguf):
    kept = _float_model(wide_gguf, use_tqdm=False)
    keep_gguf_blocks(kept, open_checkpoint(str(wide_gguf)))
    assert _greedy_tokens(kept) == _greedy_tokens(_float_model(wide_gguf, use_tqdm=False))
