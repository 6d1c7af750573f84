"""Opening a model checkpoint: its config, generation config, chat template, tokenizer, weights.

`open_checkpoint` resolves the model name (see `resolve.py`), checks that the requested
`--load-format` and `--quantization` match what is on disk, and reads the metadata; the
weights are read only when `Checkpoint.weights()` is iterated, one tensor at a time.

A folder whose config.json has a `quantization_config` is read when it is AWQ or GPTQ at
4 bits (models/int4_group_weights.py says what exactly), FP8 W8A8
(models/fp8_weights.py) or INT8 W8A8 (compressed-tensors' int-quantized,
models/int8_weights.py), and refused by name otherwise; `--quantization awq` / `gptq` (or
vLLM's `awq_marlin` / `gptq_marlin`, the same weights for its own kernels) / `fp8` must
then match the checkpoint's method. `--quantization fp8` on a folder without one asks for
its weights to be quantized at load (`Checkpoint.quantize_to_fp8`).

aioserve never executes code shipped with a model: a config that names its own classes
(`auto_map`) is refused whatever `--trust-remote-code` says (and so is vLLM's
`--code-revision`, the revision of that code). Local folders and GGUF files are read with
`local_files_only`, so opening them never reaches for the Hugging Face hub; what comes from
the hub (the model, a tokenizer, `--hf-config-path`'s config.json) comes at the revisions
and with the token of `HubOptions` (resolve.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from aioserve.kernels.gguf_linear_reference import GGUF_TYPES
from aioserve.models import fp8_weights, int8_weights, w8a8_layers
from aioserve.models.fp8_weights import Fp8Scheme
from aioserve.models.int4_group_weights import (
    GroupedCodes,
    Int4GroupScheme,
    count_layers,
    dequantized_weights,
    grouped_weights,
)
from aioserve.models.int8_weights import Int8Scheme
from aioserve.models.loaders import hf_folder
from aioserve.models.loaders.gguf import GGUFFile
from aioserve.models.loaders.gguf_tokenizer import load_gguf_tokenizer
from aioserve.models.resolve import HubOptions, ResolvedModel, resolve_model
from aioserve.models.rope_parameters import override_rope
from aioserve.models.w8a8_layers import W8A8Layer

logger = logging.getLogger("aioserve")

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
# --quantization's values -> the checkpoint's method they stand for
QUANTIZATION_METHODS = {
    None: None,
    "gguf": "gguf",
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "fp8": "fp8",
    "compressed-tensors": "compressed-tensors",
}
TOKENIZER_MODES = ("auto", "slow")


@dataclass
class Checkpoint:
    """An opened model: metadata read, weights and tokenizer read on demand."""

    hf_config: PretrainedConfig  # with --hf-overrides applied
    generation_config: dict[str, Any]  # generation_config.json, or bos/eos ids of a GGUF
    chat_template: str | None
    source: ResolvedModel
    load_format: str  # what weights() reads: "safetensors", "pt", "gguf" or "dummy"
    download_dir: str | None = None  # where load_tokenizer fetches a named tokenizer
    hub: HubOptions = HubOptions()  # the revisions and token of hub downloads
    int4_scheme: Int4GroupScheme | None = None  # an AWQ or GPTQ folder's quantization
    fp8_scheme: Fp8Scheme | None = None  # an FP8 folder's quantization
    int8_scheme: Int8Scheme | None = None  # an INT8 folder's quantization
    quantize_to_fp8: bool = False  # --quantization fp8 on a 16-bit folder
    pt_load_map_location: hf_folder.MapLocation = "cpu"  # where .bin/.pt tensors load
    _weight_files: list[Path] = field(default_factory=list, repr=False)
    _gguf: GGUFFile | None = field(default=None, repr=False)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, CPU tensor) one at a time: GGUF tensors dequantized to float32,
        folder tensors in their stored dtype, an AWQ, GPTQ, FP8 or INT8 layer as its weight
        dequantized to float32. Nothing for the dummy format."""
        if self.load_format == "gguf":
            assert self._gguf is not None
            for tensor in self._gguf.tensors():
                yield tensor.name, tensor.dequantize()
        elif self.int4_scheme is not None:
            yield from dequantized_weights(self._folder_weights(), self.int4_scheme)
        elif self.fp8_scheme is not None:
            yield from fp8_weights.dequantized_weights(self._folder_weights(), self.fp8_scheme)
        elif self.int8_scheme is not None:
            yield from int8_weights.dequantized_weights(self._folder_weights())
        elif self.load_format != "dummy":
            yield from self._folder_weights()

    def _folder_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return hf_folder.iter_weights(self._weight_files, self.pt_load_map_location)

    def int4_group_layers(self) -> Iterator[tuple[str, GroupedCodes]]:
        """(HF weight name, its codes, scales and zeros) of each layer an AWQ or GPTQ folder
        holds quantized; nothing for other checkpoints."""
        if self.int4_scheme is None:
            return
        for name, value in grouped_weights(self._folder_weights(), self.int4_scheme):
            if isinstance(value, GroupedCodes):
                yield name, value

    def fp8_layers(self) -> Iterator[tuple[str, W8A8Layer]]:
        """(HF weight name, its e4m3 values and scales) of each layer an FP8 folder holds
        quantized; nothing for other checkpoints."""
        if self.fp8_scheme is None:
            return
        for name, value in fp8_weights.fp8_layers(self._folder_weights(), self.fp8_scheme):
            if isinstance(value, W8A8Layer):
                yield name, value

    def int8_layers(self) -> Iterator[tuple[str, W8A8Layer]]:
        """(HF weight name, its int8 values and scales) of each layer an INT8 folder holds
        quantized; nothing for other checkpoints."""
        if self.int8_scheme is None:
            return
        for name, value in int8_weights.int8_layers(self._folder_weights()):
            if isinstance(value, W8A8Layer):
                yield name, value

    def gguf_blocks(self) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(HF parameter name, type, uint8 blocks [rows, bytes]) of each tensor a GGUF file
        stores in a block type the kernels read as stored (kernels/gguf_linear_reference.py
        GGUF_TYPES: "q4_0", ..., "q6_k"), rows in HF order; nothing for other checkpoints."""
        if self.load_format != "gguf":
            return
        assert self._gguf is not None
        for tensor in self._gguf.tensors():
            qtype = tensor.qtype.name.lower()
            if qtype in GGUF_TYPES:
                yield tensor.name, qtype, torch.from_numpy(np.array(tensor.raw))

    def num_weight_tensors(self) -> int:
        """How many tensors `weights()` yields (for a progress bar)."""
        if self.load_format == "gguf":
            assert self._gguf is not None
            return self._gguf.num_tensors
        if self.load_format == "dummy":
            return 0
        if self.int4_scheme is not None:
            return count_layers(hf_folder.weight_names(self._weight_files))
        if self.fp8_scheme is not None or self.int8_scheme is not None:
            return w8a8_layers.count_layers(hf_folder.weight_names(self._weight_files))
        return hf_folder.count_weights(self._weight_files)

    def stored_weight_types(self) -> dict[str, int]:
        """Bytes of weights per stored type as on disk, largest first: GGUF tensor types
        (Q4_1, F32, ...) or folder dtypes (bfloat16, ...), read from headers. Empty for
        the dummy format."""
        if self.load_format == "gguf":
            assert self._gguf is not None
            sizes = self._gguf.stored_type_bytes()
        elif self.load_format == "dummy":
            sizes = {}
        else:
            sizes = hf_folder.stored_dtype_bytes(self._weight_files)
        return dict(sorted(sizes.items(), key=lambda item: -item[1]))

    def load_tokenizer(
        self, tokenizer: str | None = None, tokenizer_mode: str = "auto"
    ) -> PreTrainedTokenizerBase:
        """The checkpoint's tokenizer, or the one at `tokenizer` (a path or model name;
        from the hub at its revision, `HubOptions.tokenizer_revision_of`).

        When the tokenizer has no chat template of its own it gets the checkpoint's.
        """
        if tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(
                f"tokenizer mode {tokenizer_mode!r} is not supported yet; "
                f"choose one of {', '.join(TOKENIZER_MODES)}"
            )
        source = self._tokenizer_source(tokenizer)
        options: dict[str, Any] = {
            "use_fast": tokenizer_mode != "slow",
            "trust_remote_code": False,
            "local_files_only": True,
        }
        if source.kind == "gguf" and options["use_fast"]:
            loaded = load_gguf_tokenizer(source.path, self.download_dir)
        elif source.kind == "gguf":
            options["gguf_file"] = source.path.name
            loaded = AutoTokenizer.from_pretrained(str(source.path.parent), **options)
        else:
            loaded = AutoTokenizer.from_pretrained(str(source.path), **options)
        if loaded.chat_template is None and self.chat_template is not None:
            loaded.chat_template = self.chat_template
        return loaded

    def _tokenizer_source(self, tokenizer: str | None) -> ResolvedModel:
        """The files of `tokenizer`: the checkpoint's own when it is the model at the model's
        revision; a tokenizer-only folder is fine here, unlike for a model; a name from the
        hub is fetched without its weights."""
        if tokenizer is None:
            return self.source
        revision = self.hub.tokenizer_revision_of(tokenizer)
        if tokenizer == self.source.name and revision == self.hub.revision:
            return self.source
        path = Path(tokenizer).expanduser()
        if path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            return ResolvedModel("hf_folder", path.resolve(), tokenizer)
        return resolve_model(
            tokenizer, self.download_dir, revision=revision, token=self.hub.token, weights=False
        )


def open_checkpoint(
    model: str,
    *,
    load_format: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
    download_dir: str | None = None,
    trust_remote_code: bool = False,
    quantization: str | None = None,
    hf_config_path: str | None = None,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    ignore_patterns: Sequence[str] = (),
    pt_load_map_location: hf_folder.MapLocation = "cpu",
    hub: HubOptions | None = None,
) -> Checkpoint:
    """Find `model` and read its metadata; weights are read later, by `Checkpoint.weights()`.

    The HF config comes from `hf_config_path` when given (a folder, or a hub id whose
    config.json is fetched), else from the model; then `hf_overrides` and the RoPE
    overrides (`--rope-scaling`, `--rope-theta`) are applied to it. A folder's weight files
    that `ignore_patterns` match are left out (and not downloaded); PyTorch weights are
    read with `pt_load_map_location` as torch.load's map_location. `hub` gives the
    revisions and token of what comes from the Hugging Face hub (the config path at the
    model's revision, as in vLLM).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load format {load_format!r} is not supported; choose one of {', '.join(LOAD_FORMATS)}"
        )
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization method {quantization!r} is not supported yet")
    hf_folder.check_map_location(pt_load_map_location)
    hub = hub or HubOptions()
    source = resolve_model(
        model, download_dir, ignore_patterns, revision=hub.revision, token=hub.token
    )
    config = (
        None if hf_config_path is None else _config_from_path(hf_config_path, download_dir, hub)
    )
    if source.kind == "gguf":
        if QUANTIZATION_METHODS[quantization] not in (None, "gguf"):
            raise ValueError(
                f"quantization {quantization!r} does not match {source.path}: a GGUF file"
            )
        checkpoint = _open_gguf(source, load_format)
        if config is not None:
            checkpoint.hf_config = config
    else:
        checkpoint = _open_folder(
            source, load_format, quantization, trust_remote_code, config, ignore_patterns
        )
    checkpoint.download_dir = download_dir
    checkpoint.hub = hub
    checkpoint.pt_load_map_location = pt_load_map_location
    _note_unused_load_options(checkpoint, ignore_patterns, pt_load_map_location)
    apply_hf_overrides(checkpoint.hf_config, hf_overrides or {})
    if rope_scaling or rope_theta is not None:
        override_rope(checkpoint.hf_config, rope_scaling or None, rope_theta, "--rope-scaling")
    return checkpoint


def _note_unused_load_options(
    checkpoint: Checkpoint, ignore_patterns: Sequence[str], map_location: hf_folder.MapLocation
) -> None:
    """Warn when --ignore-patterns or --pt-load-map-location, set to other than vLLM's
    defaults, does not apply to what this checkpoint loads (vLLM's loaders pass over them
    in silence)."""
    if checkpoint.source.kind == "gguf" and list(ignore_patterns) not in ([], ["original/**/*"]):
        logger.warning("--ignore-patterns applies to a folder's weight files, not a GGUF file")
    if map_location != "cpu" and checkpoint.load_format not in ("pt", "dummy"):
        logger.warning(
            "--pt-load-map-location %s applies to PyTorch (.bin, .pt) weights; %s weights "
            "are read on the CPU",
            map_location,
            checkpoint.load_format,
        )


def _config_from_path(
    hf_config_path: str, download_dir: str | None, hub: HubOptions
) -> PretrainedConfig:
    """The HF config of `--hf-config-path`: a folder holding config.json, or a hub id (at
    the model's revision, with the hub token)."""
    folder = Path(hf_config_path).expanduser()
    if not folder.exists():
        try:
            from huggingface_hub import hf_hub_download

            folder = Path(
                hf_hub_download(
                    hf_config_path,
                    "config.json",
                    revision=hub.revision,
                    cache_dir=download_dir,
                    token=hub.token,
                )
            ).parent
        except Exception as error:
            reason = " ".join(f"{type(error).__name__}: {error}".split())
            raise ValueError(
                f"--hf-config-path {hf_config_path!r} is not a local folder and its config.json "
                f"could not be fetched from the Hugging Face hub ({reason})"
            ) from None
    if not (folder / "config.json").is_file():
        raise ValueError(f"--hf-config-path {hf_config_path!r}: no config.json in {folder}")
    return _folder_config(folder, trust_remote_code=False)


def _open_gguf(source: ResolvedModel, load_format: str) -> Checkpoint:
    if load_format in ("safetensors", "pt"):
        raise ValueError(f"load format {load_format!r} does not match {source.path}: a GGUF file")
    gguf_file = GGUFFile(source.path)
    return Checkpoint(
        hf_config=gguf_file.hf_config(),
        generation_config=gguf_file.generation_config(),
        chat_template=gguf_file.chat_template(),
        source=source,
        load_format="dummy" if load_format == "dummy" else "gguf",
        _gguf=gguf_file,
    )


def _open_folder(
    source: ResolvedModel,
    load_format: str,
    quantization: str | None,
    trust_remote_code: bool,
    config: PretrainedConfig | None = None,
    ignore_patterns: Sequence[str] = (),
) -> Checkpoint:
    """The folder's checkpoint; its config is `config` when given (`--hf-config-path`)."""
    folder = source.path
    if load_format == "gguf" or quantization == "gguf":
        raise ValueError(
            f"{'load format' if load_format == 'gguf' else 'quantization'} 'gguf' does not match "
            f"{folder}: a Hugging Face folder, not a GGUF file"
        )
    if config is None:
        config = _folder_config(folder, trust_remote_code)
    scheme = _folder_quantization(folder, config, quantization, load_format)
    quantize_to_fp8 = scheme is None and quantization == "fp8"
    if load_format == "dummy":
        weight_format, files = "dummy", []
    else:
        weight_format = load_format
        if load_format == "auto":
            weight_format = hf_folder.detect_format(folder, ignore_patterns)
        if weight_format is None and hf_folder.weight_files(folder):
            present = hf_folder.weight_files(folder)
            raise hf_folder.ignored_everything(folder, ignore_patterns, present)
        if weight_format is None:
            raise ValueError(
                f"load format 'auto' found no safetensors or PyTorch weights in {folder}"
            )
        files = hf_folder.find_weight_files(folder, weight_format, ignore_patterns)
    return Checkpoint(
        hf_config=config,
        generation_config=_read_json(folder / "generation_config.json") or {},
        chat_template=_folder_chat_template(folder),
        source=source,
        load_format=weight_format,
        int4_scheme=scheme if isinstance(scheme, Int4GroupScheme) else None,
        fp8_scheme=scheme if isinstance(scheme, Fp8Scheme) else None,
        int8_scheme=scheme if isinstance(scheme, Int8Scheme) else None,
        quantize_to_fp8=quantize_to_fp8,
        _weight_files=files,
    )


def _folder_config(folder: Path, trust_remote_code: bool) -> PretrainedConfig:
    raw = _read_json(folder / "config.json") or {}
    if "auto_map" in raw:
        flag = " (--trust-remote-code does not change that)" if trust_remote_code else ""
        raise ValueError(
            f"the model in {folder} needs code from its repository (its config.json has an "
            f"auto_map), which aioserve never runs{flag}"
        )
    return AutoConfig.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)


def _folder_quantization(
    folder: Path, config: PretrainedConfig, quantization: str | None, load_format: str
) -> Int4GroupScheme | Fp8Scheme | Int8Scheme | None:
    """The folder's AWQ, GPTQ, FP8 or INT8 scheme (None: not quantized), checked against
    `--quantization`; ValueError for a quantization that is not supported or not matched.
    `--quantization fp8` on a folder without a quantization_config quantizes it at load."""
    raw = getattr(config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    wanted = QUANTIZATION_METHODS[quantization]
    if raw is None:
        if wanted not in (None, "fp8"):
            raise ValueError(
                f"--quantization {quantization} does not match {folder}: its config.json has "
                "no quantization_config (of the methods, only fp8 quantizes weights at load)"
            )
        return None
    scheme: Int4GroupScheme | Fp8Scheme | Int8Scheme
    if int8_weights.is_int8_config(raw):
        scheme = Int8Scheme.from_config(raw)
    elif fp8_weights.is_fp8_config(raw) or raw.get("quant_method") == "compressed-tensors":
        scheme = Fp8Scheme.from_config(raw)
    else:
        scheme = Int4GroupScheme.from_config(raw)
    if wanted is not None and wanted != scheme.method:
        raise ValueError(
            f"--quantization {quantization} does not match {folder}: its quantization_config "
            f"says {scheme.method}"
        )
    if load_format == "dummy":
        raise ValueError(
            f"--load-format dummy is not supported for a {scheme.method} checkpoint: random "
            "quantized weights are not built"
        )
    return scheme


def _folder_chat_template(folder: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (its default if named)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = (_read_json(folder / "tokenizer_config.json") or {}).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def apply_hf_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    """Merge `overrides` into `config`: nested dicts merge key by key, other values replace.
    `rope_scaling` and `rope_theta` replace the RoPE scaling and base as `--rope-scaling` and
    `--rope-theta` do (rope_parameters.override_rope)."""
    for key, value in overrides.items():
        if key in ("rope_scaling", "rope_theta"):
            rope = {"scaling": value} if key == "rope_scaling" else {"theta": value}
            override_rope(config, **rope, flag="--hf-overrides")
            continue
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, _merged(current, value))
        else:
            setattr(config, key, value)


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merged(result[key], value)
        else:
            result[key] = value
    return result


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None
