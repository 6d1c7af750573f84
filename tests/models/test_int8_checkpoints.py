"""INT8 W8A8 checkpoints (compressed-tensors' int-quantized) through the normal loading path,
on tiny Llamas written by tests/models/tiny_int8.py with numpy's own rounding:

- the loaded weights are the checkpoint's values times its scales, exactly;
- kept as stored (on the CPU as on a GPU), every decoder Linear holds the int8 weights and
  its float weight is released; the model's logits are those of transformers' Llama on the
  dequantized weights with each projection's input rounded per row to int8 steps (an
  independent W8A8), and further from the unrounded model's;
- on a CPU whose int8 GEMM saturates (no VNNI) the engine computes on the dequantized
  weights instead, and says so;
- what is not supported is refused by name, and `--quantization` must match.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import LlamaForCausalLM

from aioserve import LLM, SamplingParams
from aioserve.kernels import int8_linear_reference
from aioserve.kernels.int8_linear_reference import MIN_SCALE, int8_gemm_exact
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.int8_weights import keep_int8_weights
from aioserve.models.linear import Linear
from aioserve.models.loader import load_model
from tests.models.test_int4_group_checkpoints import KEPT, PROMPT, _prompt_logits
from tests.models.tiny_int8 import write_tiny_int8
from tests.models.tiny_quantized import PROJECTIONS, tiny_config

# Float32 on both sides, the same int8 steps: what differs is the order of the float sums
# (3e-7 of the logits' norm, measured over three seeds and both strategies) and, once in
# those six, a step flipped where an input landed within that rounding of a half step
# (4e-4). The unrounded model is 0.009-0.011 away.
_SAME_W8A8 = 2e-3
_ROUNDING_SHOWS = 5e-3


@pytest.fixture(scope="module", params=["channel", "tensor"])
def folder(request, tmp_path_factory):
    """(folder, the float32 state dict it stands for)."""
    path = tmp_path_factory.mktemp(request.param)
    return path, write_tiny_int8(path, per_channel=request.param == "channel")


def _load(path, quantization=None):
    checkpoint = open_checkpoint(str(path), quantization=quantization)
    model = load_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"), use_tqdm=False)
    return checkpoint, model


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _transformers_logits(state: dict[str, torch.Tensor], w8a8: bool) -> torch.Tensor:
    """transformers' Llama on `state`; with `w8a8`, each projection's input rounded per row
    to multiples of max |row| / 127 first (what the int8 kernels multiply)."""
    config = tiny_config()
    config._attn_implementation = "eager"
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(state)
    if w8a8:
        for name, module in hf.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                module.register_forward_pre_hook(lambda _, args: (_rounded_rows(args[0]),))
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0]


def _rounded_rows(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=MIN_SCALE)
    return torch.round(x / scale).clamp(-127, 127) * scale


def test_the_weights_are_the_dequantized_checkpoints(folder):
    path, expected = folder
    checkpoint, model = _load(path)
    assert checkpoint.int8_scheme is not None and checkpoint.fp8_scheme is None
    assert checkpoint.num_weight_tensors() == len(expected)
    loaded = dict(checkpoint.weights())
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name].float(), tensor), name


def test_kept_as_stored_the_model_computes_w8a8(folder):
    path, expected = folder
    checkpoint, model = _load(path)
    kept = keep_int8_weights(model, checkpoint.int8_layers())
    holding = {
        n for n, m in model.named_modules() if isinstance(m, Linear) and m.int8_weight is not None
    }
    assert holding == KEPT
    assert kept == sum(
        m.int8_weight.nbytes + m.int8_scale.nbytes for m in map(model.get_submodule, KEPT)
    )
    for name in KEPT:
        module = model.get_submodule(name)
        assert module.weight.stride() == (0, 0)  # the float weight released: a shape only
        assert module.int8_weight.dtype == torch.int8
    # Stacked shards keep each one's values and scales: q/k/v as the checkpoint holds them.
    qkv = model.get_submodule("layers.1.self_attn.qkv_proj")
    q, k, v = (expected[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    dequantized = qkv.int8_weight.float() * qkv.int8_scale.reshape(-1, 1)
    assert torch.equal(dequantized, torch.cat([q, k, v]))
    logits = _prompt_logits(model)
    assert _relative(logits, _transformers_logits(expected, w8a8=True)) < _SAME_W8A8
    assert _relative(logits, _transformers_logits(expected, w8a8=False)) > _ROUNDING_SHOWS


def test_the_quantization_flag_must_match(folder):
    path, _ = folder
    assert open_checkpoint(str(path), quantization="compressed-tensors").int8_scheme
    with pytest.raises(ValueError, match="--quantization fp8 does not match .* compressed-tensors"):
        open_checkpoint(str(path), quantization="fp8")


def test_symmetric_zero_points_may_be_left_out(tmp_path):
    expected = write_tiny_int8(tmp_path, zero_points=False)
    checkpoint, _ = _load(tmp_path)
    assert dict(checkpoint.weights()).keys() == expected.keys()


def _rewrite(folder, edit) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    edit(raw["quantization_config"])
    path.write_text(json.dumps(raw))


def _group(config: dict) -> dict:
    return config["config_groups"]["group_0"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: _group(c)["weights"].update(symmetric=False), "asymmetric weights"),
        (lambda c: _group(c)["weights"].update(strategy="group", group_size=32),
         "weight strategy 'group'"),
        (lambda c: _group(c)["weights"].update(num_bits=4), "only 8-bit integer weights"),
        (lambda c: _group(c).update(input_activations=None), "only dynamic 8-bit integer input"),
        (lambda c: _group(c)["input_activations"].update(dynamic=False),
         "only dynamic 8-bit integer input"),
        (lambda c: _group(c)["input_activations"].update(symmetric=False),
         "only symmetric 8-bit input"),
        (lambda c: c.update(format="pack-quantized"), "format 'pack-quantized'"),
    ],
)  # fmt: skip
def test_what_is_not_supported_is_refused_by_name(tmp_path, edit, message):
    write_tiny_int8(tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        open_checkpoint(str(tmp_path))


def test_a_nonzero_zero_point_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    write_tiny_int8(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight_zero_point"
    tensors[name] = torch.ones_like(tensors[name])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name} with nonzero values"):
        dict(open_checkpoint(str(tmp_path)).weights())


def test_served_compiled_the_engine_gives_the_eager_engines_tokens(tmp_path):
    # The CPU's serving path: the step compiled (the int8 products and the rounding of
    # their inputs inside the graphs), float32 so that both sides round alike.
    write_tiny_int8(tmp_path)
    prompts = [
        {"prompt_token_ids": [5 + i, 17, 3, 9, 30, 12, 8, 200, 41][: 3 + i]} for i in range(6)
    ]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        with LLM(
            model=str(tmp_path),
            skip_tokenizer_init=True,
            dtype="float32",
            enforce_eager=eager,
            max_model_len=128,
        ) as llm:
            report = llm.engine.settings.load_report
            assert report.quantization.startswith("INT8 W8A8")
            assert bool(report.kept_blocks_bytes) == int8_gemm_exact()
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
        tokens[eager] = [list(output.outputs[0].token_ids) for output in outputs]
    assert tokens[False] == tokens[True]


def test_a_cpu_whose_int8_gemm_saturates_gets_the_dequantized_weights(
    tmp_path, monkeypatch, caplog
):
    write_tiny_int8(tmp_path)
    monkeypatch.setattr(int8_linear_reference, "_EXACT", False)
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=128)
    with llm:
        report = llm.engine.settings.load_report
        assert report.kept_blocks_bytes == 0
        assert "dequantized to float32" in report.describe()
        assert llm.generate([{"prompt_token_ids": [5, 17, 3]}], use_tqdm=False)
    assert "the INT8 layers are dequantized at load" in caplog.text
