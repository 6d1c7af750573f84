"""Our GGUF loader against the gguf package and against transformers' own GGUF loading.

- dequantization of each type equals `gguf.quants.dequantize` (numpy);
- tiny GGUF files written with `gguf.GGUFWriter` (tiny_gguf.py: Q/K permuted the way llama.cpp's
  converter does) read back as the state dict they were written from;
- the default model (SmolLM2-135M-Instruct, Q4_1): config, every tensor and the tokenizer
  equal what transformers builds from the same file.
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from transformers import AutoModelForCausalLM, AutoTokenizer

from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loaders.gguf import SUPPORTED_QTYPES, GGUFFile, QType, check_qtype, dequantize
from tests.models.tiny_gguf import tiny_state_dict, write_tiny_gguf

ROWS, COLS = 3, 512  # two 256-value super-blocks per row for the K types

QUANTIZABLE = [
    QType.F32,
    QType.F16,
    QType.BF16,
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
]
HAND_BUILT = {QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}  # fp16 scale offsets


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_quantized_values(qtype):
    values = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = gguf_quantize(values, qtype).view(np.uint8)
    ours = dequantize(raw, qtype, (ROWS, COLS))
    assert ours.dtype == torch.float32 and ours.shape == (ROWS, COLS)
    torch.testing.assert_close(ours, torch.from_numpy(gguf_dequantize(raw, qtype)), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", list(HAND_BUILT), ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_random_blocks(qtype):
    # gguf has no numpy quantizer for the K types: random bytes, with finite fp16 scales
    rng = np.random.default_rng(1)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // block_values, block_bytes), dtype=np.uint8)
    for offset in HAND_BUILT[qtype]:
        scales = rng.uniform(-2, 2, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    raw = blocks.reshape(ROWS, -1)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype))
    torch.testing.assert_close(dequantize(raw, qtype, (ROWS, COLS)), expected, rtol=0, atol=0)


def test_unsupported_type_is_named():
    assert QType.Q2_K not in SUPPORTED_QTYPES
    with pytest.raises(ValueError, match="Q2_K .*blk.0.ffn_up.weight.*supported: F32"):
        check_qtype(QType.Q2_K, "blk.0.ffn_up.weight")


# --- tiny GGUF files written here ---------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_reads_back_as_written(tmp_path, arch):
    state = tiny_state_dict(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, state)

    gguf_file = GGUFFile(path)
    config = gguf_file.hf_config()
    assert config.architectures == [f"{arch.capitalize()}ForCausalLM"]
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (40, 64, 96)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        2,
        4,
        2,
    )
    assert (config.head_dim, config.max_position_embeddings, config.rms_norm_eps) == (32, 256, 1e-6)
    assert config.tie_word_embeddings == (arch != "qwen3")
    if arch == "llama":
        assert config.attention_bias
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    rope = getattr(config, "rope_parameters", None) or {
        "rope_theta": config.rope_theta,
        **config.rope_scaling,
    }
    assert rope["rope_theta"] == 500000.0
    assert (rope["rope_type"], rope["factor"]) == ("linear", 4.0)
    assert gguf_file.generation_config() == {"bos_token_id": 1, "eos_token_id": [2, 3]}
    assert gguf_file.chat_template() == "{{ messages[0]['content'] }}"

    tensors = {t.name: t for t in gguf_file.tensors()}
    assert set(tensors) == set(state)
    for name, tensor in tensors.items():
        value = tensor.dequantize()
        assert tensor.shape == state[name].shape == tuple(value.shape), name
        expected = torch.from_numpy(state[name])
        if tensor.qtype == QType.Q8_0:
            # the raw blocks are in HF order too: the numpy reference agrees on them
            assert tensor.raw.dtype == np.uint8
            reference = torch.from_numpy(gguf_dequantize(tensor.raw, tensor.qtype))
            torch.testing.assert_close(value, reference, rtol=0, atol=0)
            torch.testing.assert_close(value, expected, rtol=0, atol=0.02)
        else:
            torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_open_checkpoint_on_a_gguf(tmp_path):
    state = tiny_state_dict("llama")
    write_tiny_gguf(tmp_path / "tiny.gguf", "llama", state)
    checkpoint = open_checkpoint(str(tmp_path), quantization="gguf")  # the folder's one GGUF
    assert (checkpoint.source.kind, checkpoint.load_format) == ("gguf", "gguf")
    assert dict(checkpoint.weights()).keys() == state.keys()
    assert checkpoint.num_weight_tensors() == len(state)
    assert checkpoint.generation_config["eos_token_id"] == [2, 3]
    assert checkpoint.chat_template == "{{ messages[0]['content'] }}"

    dummy = open_checkpoint(
        str(tmp_path / "tiny.gguf"), load_format="dummy", hf_overrides={"num_hidden_layers": 1}
    )
    assert list(dummy.weights()) == [] and dummy.num_weight_tensors() == 0
    assert dummy.hf_config.num_hidden_layers == 1
    for load_format in ("safetensors", "pt"):
        with pytest.raises(ValueError, match=f"'{load_format}' does not match .*tiny.gguf: a GGUF"):
            open_checkpoint(str(tmp_path), load_format=load_format)
    with pytest.raises(ValueError, match="quantization 'awq' does not match .*tiny.gguf: a GGUF"):
        open_checkpoint(str(tmp_path), quantization="awq")


def test_unknown_architecture_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' .*not supported"):
        GGUFFile(path).hf_config()


# --- the default model against transformers -----------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return open_checkpoint(str(smollm2_gguf))


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_gguf):
    """transformers' own model from the same GGUF (its config comes from AutoConfig)."""
    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    )


def test_config_matches_transformers(smollm2, transformers_smollm2):
    ours = smollm2.hf_config
    theirs = transformers_smollm2.config
    fields = [
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "head_dim",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
    ]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert math.isclose(ours.rms_norm_eps, theirs.rms_norm_eps, rel_tol=1e-6)
    if hasattr(theirs, "rope_parameters"):
        assert ours.rope_parameters == theirs.rope_parameters
    else:
        assert (ours.rope_theta, ours.rope_scaling) == (theirs.rope_theta, theirs.rope_scaling)
    assert ours.architectures == ["LlamaForCausalLM"]


def test_every_tensor_matches_transformers(smollm2, transformers_smollm2):
    expected = transformers_smollm2.state_dict()
    seen = set()
    for name, tensor in smollm2.weights():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
        seen.add(name)
    # the tied lm_head is the embedding, not a tensor of its own
    assert seen | {"lm_head.weight"} == set(expected)
    assert smollm2.num_weight_tensors() == len(seen) == 272


def test_tokenizer_matches_transformers(smollm2_gguf, smollm2):
    ours = smollm2.load_tokenizer()
    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in ["Hello world!", "  leading spaces, ünïcödé and 数字 123", "<|im_start|>user\nhi"]:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"]
        assert ours.decode(ids) == text
    assert len(ours) == smollm2.hf_config.vocab_size
    assert ours.eos_token_id == smollm2.generation_config["eos_token_id"]
    assert smollm2.chat_template is not None
    assert ours.chat_template == smollm2.chat_template
    prompt = ours.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_default_model_checkpoint(smollm2):
    assert (smollm2.source.kind, smollm2.load_format) == ("gguf", "gguf")
    assert smollm2.generation_config == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert smollm2.chat_template.startswith("{% for message in messages %}")


def test_the_converted_tokenizer_is_cached_and_reads_back_the_same(
    smollm2_gguf, tmp_path, monkeypatch, caplog
):
    from aioserve.models.loaders import gguf_tokenizer
    from aioserve.models.resolve import CACHE_DIR_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    conversions = []
    from_pretrained = AutoTokenizer.from_pretrained

    def counting(folder, **options):
        if "gguf_file" in options:
            conversions.append(folder)
        return from_pretrained(folder, **options)

    monkeypatch.setattr(gguf_tokenizer.AutoTokenizer, "from_pretrained", counting)
    converted = gguf_tokenizer.load_gguf_tokenizer(smollm2_gguf)
    folder = gguf_tokenizer.cached_tokenizer_folder(smollm2_gguf)
    assert folder.parent == tmp_path / "tokenizers" and (folder / "tokenizer.json").is_file()
    cached = gguf_tokenizer.load_gguf_tokenizer(smollm2_gguf)
    assert len(conversions) == 1, "the second load must read the cache"
    theirs = from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    texts = ["Hello world!", "  ünïcödé, 数字 123\n\t", "<|im_start|>user\nhi<|im_end|>"]
    for tokenizer in (converted, cached):
        for text in texts:
            ids = theirs(text)["input_ids"]
            assert tokenizer(text)["input_ids"] == ids
            assert tokenizer.decode(ids) == theirs.decode(ids)
        assert tokenizer.all_special_ids == theirs.all_special_ids
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
        assert tokenizer.chat_template == theirs.chat_template
        assert len(tokenizer) == len(theirs)
    # A damaged cache is converted again, with a warning, and replaced.
    (folder / "tokenizer.json").write_text("{not json")
    (folder / "tokenizer_config.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="aioserve"):
        again = gguf_tokenizer.load_gguf_tokenizer(smollm2_gguf)
    assert len(conversions) == 2 and "unreadable" in caplog.text
    assert again(texts[1])["input_ids"] == theirs(texts[1])["input_ids"]
    gguf_tokenizer.load_gguf_tokenizer(smollm2_gguf)
    assert len(conversions) == 2, "the damaged cache was replaced"
