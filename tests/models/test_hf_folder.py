"""Hugging Face folders: every way transformers and torch save weights reads back exactly,
and open_checkpoint's checks (load format, remote code, quantization) and overrides."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from aioserve.models.checkpoint import open_checkpoint

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _save_tokenizer(folder, chat_template: str | None = None) -> None:
    vocab = {word: i for i, word in enumerate(["<unk>", "<s>", "</s>", "hello", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


def _assert_yields_state_dict(folder, model, load_format: str, expected_format: str) -> None:
    checkpoint = open_checkpoint(str(folder), load_format=load_format)
    assert checkpoint.load_format == expected_format
    loaded = dict(checkpoint.weights())
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.bfloat16  # the stored dtype, untouched
        assert torch.equal(loaded[name], tensor), name
    assert checkpoint.num_weight_tensors() == len(expected)


def test_single_safetensors(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    _assert_yields_state_dict(tmp_path, tiny_llama, "auto", "safetensors")
    _assert_yields_state_dict(tmp_path, tiny_llama, "safetensors", "safetensors")


def test_sharded_safetensors(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path, max_shard_size="2KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    _assert_yields_state_dict(tmp_path, tiny_llama, "auto", "safetensors")


def test_pytorch_bin(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    torch.save(tiny_llama.state_dict(), tmp_path / "pytorch_model.bin")
    torch.save({"step": torch.tensor(3)}, tmp_path / "training_args.bin")  # not weights
    _assert_yields_state_dict(tmp_path, tiny_llama, "auto", "pt")
    _assert_yields_state_dict(tmp_path, tiny_llama, "pt", "pt")


def test_sharded_pytorch_bins(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    names = list(tiny_llama.state_dict())
    shards = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"pytorch_model-0000{i}-of-00002.bin"
        torch.save({n: tiny_llama.state_dict()[n] for n in shard}, tmp_path / filename)
        weight_map |= {n: filename for n in shard}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    _assert_yields_state_dict(tmp_path, tiny_llama, "auto", "pt")


def test_load_format_mismatches_name_the_format_and_path(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path / "st")
    with pytest.raises(ValueError, match=f"'pt' found no pt weight files in {tmp_path / 'st'}"):
        open_checkpoint(str(tmp_path / "st"), load_format="pt")
    with pytest.raises(ValueError, match=f"'gguf' does not match {tmp_path / 'st'}"):
        open_checkpoint(str(tmp_path / "st"), load_format="gguf")
    with pytest.raises(ValueError, match="quantization 'gguf' does not match"):
        open_checkpoint(str(tmp_path / "st"), quantization="gguf")
    with pytest.raises(ValueError, match="load format 'npcache' is not supported"):
        open_checkpoint(str(tmp_path / "st"), load_format="npcache")

    tiny_llama.config.save_pretrained(tmp_path / "bin")
    torch.save(tiny_llama.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=f"'safetensors' found no .* in {tmp_path / 'bin'}"):
        open_checkpoint(str(tmp_path / "bin"), load_format="safetensors")

    tiny_llama.config.save_pretrained(tmp_path / "none")
    with pytest.raises(ValueError, match="found no safetensors or PyTorch weights"):
        open_checkpoint(str(tmp_path / "none"))


def test_dummy_reads_only_the_config(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(str(tmp_path), load_format="dummy")
    assert checkpoint.hf_config.hidden_size == 16
    assert list(checkpoint.weights()) == [] and checkpoint.num_weight_tensors() == 0


def test_remote_code_is_never_run(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for trust in (False, True):
        with pytest.raises(ValueError, match="needs code from its repository.*never runs"):
            open_checkpoint(str(tmp_path), load_format="dummy", trust_remote_code=trust)


def test_quantized_folders_are_refused(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization method 'bitsandbytes' is not supported yet"):
        open_checkpoint(str(tmp_path), load_format="dummy")
    with pytest.raises(ValueError, match="quantization method 'hqq' is not supported yet"):
        open_checkpoint(str(tmp_path), quantization="hqq")


def test_hf_overrides_merge_into_the_config(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["extra"] = {"kept": 1, "nested": {"a": 1, "b": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    overrides = {"num_hidden_layers": 1, "extra": {"nested": {"b": 3}, "new": True}}
    checkpoint = open_checkpoint(str(tmp_path), load_format="dummy", hf_overrides=overrides)
    assert checkpoint.hf_config.num_hidden_layers == 1
    assert checkpoint.hf_config.extra == {"kept": 1, "nested": {"a": 1, "b": 3}, "new": True}
    assert checkpoint.hf_config.hidden_size == 16


def test_generation_config_chat_template_and_tokenizer(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    generation = {"eos_token_id": [2, 3], "temperature": 0.6}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    _save_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    checkpoint = open_checkpoint(str(tmp_path), load_format="dummy")
    assert checkpoint.generation_config == generation
    assert checkpoint.chat_template == TEMPLATE

    tokenizer = checkpoint.load_tokenizer()
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    assert tokenizer.chat_template == TEMPLATE

    # a separate tokenizer without a template gets the checkpoint's
    _save_tokenizer(tmp_path / "tok")
    assert checkpoint.load_tokenizer(str(tmp_path / "tok")).chat_template == TEMPLATE
    with pytest.raises(ValueError, match="tokenizer mode 'mistral' is not supported"):
        checkpoint.load_tokenizer(tokenizer_mode="mistral")


def test_chat_template_from_tokenizer_config(tmp_path, tiny_llama):
    tiny_llama.config.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "tool_use", "template": "x"},
                    {"name": "default", "template": TEMPLATE},
                ]
            }
        )
    )
    checkpoint = open_checkpoint(str(tmp_path), load_format="dummy")
    assert checkpoint.chat_template == TEMPLATE
    assert checkpoint.generation_config == {}
