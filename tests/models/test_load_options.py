"""--ignore-patterns and --pt-load-map-location (vLLM's LoadConfig): the weight files a
pattern matches are left out of a folder's listing (and of a hub download), so a folder
whose ignored file holds other weights loads the right ones; the map location reaches
torch.load for PyTorch bins. Patterns match as huggingface_hub's filter_repo_objects (the
reference: vLLM hands them to its snapshot_download)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from aioserve import LLM, SamplingParams
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.models import resolve
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.loaders import hf_folder
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

DEFAULT = ["original/**/*"]  # vLLM's default --ignore-patterns


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=generator), "b": torch.randn(4, generator=generator)}


def _folder(tmp_path: Path, name: str = "model") -> Path:
    """A folder holding a tiny Llama's config.json, no weights yet."""
    folder = tmp_path / name
    tiny_llama_config().save_pretrained(folder)
    return folder


def _loaded(folder: Path, **options) -> dict[str, torch.Tensor]:
    return dict(open_checkpoint(str(folder), **options).weights())


def _assert_state(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_keywords_take_vllms_forms():
    load = engine_config_from_kwargs().load
    assert (load.ignore_patterns, load.pt_load_map_location) == (DEFAULT, "cpu")
    load = engine_config_from_kwargs(ignore_patterns="*.bin", pt_load_map_location="cuda").load
    assert (load.ignore_patterns, load.pt_load_map_location) == (["*.bin"], "cuda")
    assert engine_config_from_kwargs(ignore_patterns=[]).load.ignore_patterns == []
    remap = {"cuda:1": "cuda:0", "": "cpu"}
    assert engine_config_from_kwargs(pt_load_map_location=remap).load.pt_load_map_location == remap
    with pytest.raises(ConfigError, match="^pt_load_map_location must be a device"):
        engine_config_from_kwargs(pt_load_map_location="meta")
    with pytest.raises(ConfigError, match="^ignore_patterns must be one or more glob patterns"):
        engine_config_from_kwargs(ignore_patterns=[3])


PATHS = [
    "model.safetensors",
    "pytorch_model.bin",
    "consolidated.safetensors",
    "original/consolidated.00.pth",
    "original/params.json",
    "original/sub/model.safetensors",
    "shards/model-00001-of-00002.safetensors",
    "Model.SafeTensors",
]
PATTERNS = [
    "original/**/*",
    "original/*",
    "original/",
    "*.safetensors",
    "model.*",
    "*/model*",
    "consolidated*",
    "shards/model-0000[1]-*",
    "",
]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_match_as_huggingface_hub_filters_downloads(pattern):
    expected = set(PATHS) - set(filter_repo_objects(PATHS, ignore_patterns=[pattern]))
    assert {path for path in PATHS if hf_folder.ignored(path, [pattern])} == expected
    assert not any(hf_folder.ignored(path, []) for path in PATHS)


def test_an_ignored_safetensors_file_leaves_the_pytorch_bin_to_load(tmp_path):
    folder = _folder(tmp_path)
    save_file(_state(0), folder / "model.safetensors")
    torch.save(_state(1), folder / "pytorch_model.bin")
    _assert_state(_loaded(folder, ignore_patterns=DEFAULT), _state(0))
    checkpoint = open_checkpoint(str(folder), ignore_patterns=["*.safetensors"])
    assert checkpoint.load_format == "pt"
    _assert_state(dict(checkpoint.weights()), _state(1))
    assert checkpoint.num_weight_tensors() == 2


def test_an_ignored_single_file_leaves_the_others(tmp_path, caplog):
    folder = _folder(tmp_path)
    save_file(_state(0), folder / "model.safetensors")
    save_file(_state(1), folder / "consolidated.safetensors")
    _assert_state(_loaded(folder), _state(0))  # model.safetensors alone, as before
    with caplog.at_level(logging.INFO, logger="aioserve"):
        loaded = _loaded(folder, ignore_patterns=["model.*"], load_format="safetensors")
    _assert_state(loaded, _state(1))
    assert "--ignore-patterns skips 1 weight files: model.safetensors" in caplog.text


def test_metas_original_folder_stays_unread(tmp_path):
    """A Llama repository's layout: HF weights at the top, Meta's consolidated checkpoint
    under original/. The top's weights load, with or without the default pattern; a folder
    with only original/ has nothing aioserve reads."""
    folder = _folder(tmp_path)
    save_file(_state(0), folder / "model.safetensors")
    (folder / "original").mkdir()
    torch.save(_state(1), folder / "original" / "consolidated.00.pth")
    (folder / "original" / "params.json").write_text("{}")
    for patterns in (DEFAULT, []):
        _assert_state(_loaded(folder, ignore_patterns=patterns), _state(0))
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="found no safetensors or PyTorch weights"):
        open_checkpoint(str(folder), ignore_patterns=DEFAULT)


def test_an_index_shard_under_original_is_skipped_by_the_default(tmp_path, caplog):
    folder = _folder(tmp_path)
    (folder / "original" / "extra").mkdir(parents=True)
    save_file({"w": _state(0)["w"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": _state(1)["b"]}, folder / "original" / "extra" / "rest.safetensors")
    shards = {"w": "model-00001-of-00002.safetensors", "b": "original/extra/rest.safetensors"}
    index = {"metadata": {}, "weight_map": shards}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _assert_state(_loaded(folder, ignore_patterns=[]), {"w": _state(0)["w"], "b": _state(1)["b"]})
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        _assert_state(_loaded(folder, ignore_patterns=DEFAULT), {"w": _state(0)["w"]})
    assert "skips 1 of the shards model.safetensors.index.json lists" in caplog.text


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "pt"])
def test_a_folder_whose_every_weight_file_is_ignored_is_refused(tmp_path, load_format):
    folder = _folder(tmp_path)
    save_file(_state(0), folder / "model.safetensors")
    torch.save(_state(1), folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as refused:
        open_checkpoint(str(folder), load_format=load_format, ignore_patterns=["*.bin", "model*"])
    message = str(refused.value)
    assert message.startswith("--ignore-patterns '*.bin' 'model*' skips every weight file in")
    assert message.endswith("nothing is left to load")
    assert {"auto": "model.safetensors, pytorch_model.bin", "pt": "(pytorch_model.bin)"}.get(
        load_format, "(model.safetensors)"
    ) in message


def test_a_hub_download_skips_the_ignored_weights_only(tmp_path, monkeypatch):
    """Metadata is fetched whatever the patterns; weight files with them (vLLM hands them to
    snapshot_download); when every safetensors file is ignored the bins are fetched."""
    folder = _folder(tmp_path)
    calls = []

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns, cache_dir, token):
        assert token is None  # no --hf-token given
        calls.append((repo_id, revision, allow_patterns, ignore_patterns, cache_dir))
        if allow_patterns == ["*.safetensors"] and not (folder / "model.safetensors").exists():
            save_file(_state(0), folder / "model.safetensors")
        if allow_patterns == ["*.bin", "*.pt"]:
            torch.save(_state(1), folder / "pytorch_model.bin")
        return str(folder)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    source = resolve.resolve_model("org/tiny", str(tmp_path / "dl"), ["*.safetensors"])
    assert source == resolve.ResolvedModel("hf_folder", folder, "org/tiny")
    dl = str(tmp_path / "dl")
    # The weights at the commit the metadata's snapshot is (the folder's name).
    commit = folder.name
    assert calls == [
        ("org/tiny", None, resolve._HUB_PATTERNS, None, dl),
        ("org/tiny", commit, ["*.safetensors"], ["*.safetensors"], dl),
        ("org/tiny", commit, ["*.bin", "*.pt"], ["*.safetensors"], dl),
    ]
    calls.clear()
    assert resolve.resolve_model("org/tiny", dl, DEFAULT).path == folder
    assert [call[2:4] for call in calls] == [
        (resolve._HUB_PATTERNS, None),
        (["*.safetensors"], DEFAULT),
    ]


def _save_as_if_on(device: str, state: dict[str, torch.Tensor], path: Path, monkeypatch) -> None:
    """torch.save `state` with its storages tagged as saved on `device` (a GPU this machine
    may not have): torch.load then needs a map_location that moves them."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: device)
        torch.save(state, path)


@pytest.mark.parametrize(
    "location", ["cpu", {"cuda:1": "cpu"}, {"cuda:0": "cpu", "cuda:1": "cpu"}, '{"cuda:1": "cpu"}']
)
def test_the_map_location_reaches_torch_load(tmp_path, monkeypatch, location):
    if torch.cuda.device_count() > 1:
        pytest.skip("a second GPU would take the tensors without a map location")
    folder = _folder(tmp_path)
    _save_as_if_on("cuda:1", _state(2), folder / "pytorch_model.bin", monkeypatch)
    if isinstance(location, str) and location.startswith("{"):
        location = json.loads(location)
    checkpoint = open_checkpoint(str(folder), pt_load_map_location=location)
    loaded = dict(checkpoint.weights())
    _assert_state(loaded, _state(2))
    assert {tensor.device.type for tensor in loaded.values()} == {"cpu"}
    assert checkpoint.num_weight_tensors() == 2  # the names: read on the CPU whatever the map


@pytest.mark.parametrize("location", [{}, {"cuda:2": "cpu"}])
def test_without_a_mapping_for_the_saved_device_torch_load_fails(tmp_path, monkeypatch, location):
    if torch.cuda.is_available():
        pytest.skip("a GPU would take the tensors without a map location")
    folder = _folder(tmp_path)
    _save_as_if_on("cuda:1", _state(2), folder / "pytorch_model.bin", monkeypatch)
    checkpoint = open_checkpoint(str(folder), pt_load_map_location=location)
    with pytest.raises(RuntimeError, match="CUDA"):
        dict(checkpoint.weights())


@pytest.mark.parametrize("location", ["cuda", "cuda:0", {"cpu": "cuda:7"}])
def test_a_gpu_this_machine_lacks_is_refused_at_open(tmp_path, location):
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has the GPUs")
    if torch.cuda.is_available() and location in ("cuda", "cuda:0"):
        pytest.skip("this machine has the GPU")
    folder = _folder(tmp_path)
    torch.save(_state(0), folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="^--pt-load-map-location sends tensors to cuda"):
        open_checkpoint(str(folder), pt_load_map_location=location)


def test_a_map_location_on_safetensors_is_reported_unused(tmp_path, caplog):
    folder = _folder(tmp_path)
    save_file(_state(0), folder / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="aioserve"):
        _assert_state(_loaded(folder, pt_load_map_location={"cuda:1": "cpu"}), _state(0))
    assert "--pt-load-map-location {'cuda:1': 'cpu'} applies to PyTorch" in caplog.text


def _greedy_reference(folder: Path, prompt: list[int], new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, min_length=0
        )
    return out[0, len(prompt) :].tolist()


def test_llm_loads_the_weights_the_patterns_leave(tmp_path, monkeypatch):
    """LLM(ignore_patterns=..., pt_load_map_location=...): a folder with safetensors of
    one tiny Llama and a PyTorch bin of another (saved as if from cuda:1) generates the
    bin's tokens, as transformers does from the bin alone."""
    config = tiny_llama_config()
    safetensors_folder = save_tiny_model(config, tmp_path / "a", seed=0)
    bin_folder = save_tiny_model(config, tmp_path / "b", seed=1)
    mixed = tmp_path / "mixed"
    config.save_pretrained(mixed)
    (mixed / "model.safetensors").write_bytes(
        (safetensors_folder / "model.safetensors").read_bytes()
    )
    bin_state = load_file(bin_folder / "model.safetensors")
    _save_as_if_on("cuda:1", bin_state, mixed / "pytorch_model.bin", monkeypatch)

    prompt, new_tokens = [5, 17, 42, 9], 8
    expected = _greedy_reference(bin_folder, prompt, new_tokens)
    assert expected != _greedy_reference(safetensors_folder, prompt, new_tokens)
    with LLM(
        model=str(mixed),
        ignore_patterns=["*.safetensors"],
        pt_load_map_location={"cuda:1": "cpu"},
        dtype="float32",
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=16,
        max_num_seqs=2,
        max_model_len=64,
    ) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
