"""Pooling a pooling model's hidden states into one embedding a prompt, and the settings
that say how (vLLM's pooler config for the `embed` task; for a sequence classifier, the
`classify` task: the CLS row into its head, then vLLM's activation, models/bert_classifiers.py).

Where the settings come from, first match wins, as vLLM 0.32 resolves them
(vllm/config/model.py, vllm/transformers_utils/config.py `get_pooling_config`):

1. `--pooler-config` (a JSON object; the `overrides` here): `pooling_type` (or its
   synonym `seq_pooling_type`) and `use_activation` (for embeddings: L2 normalization);
2. a sentence-transformers folder: its modules.json's Pooling module (its config.json's
   `pooling_mode` or `pooling_mode_*` flag) and whether a Normalize module is listed;
3. the architecture's default (models/registry.py POOLING_ARCHITECTURES: CLS for a BERT;
   LAST for a generative model converted to embeddings) and normalization on.

Where aioserve differs from vLLM, it refuses rather than computing something else: a
sentence-transformers pooling of max, mean_sqrt_len or weighted mean (vLLM falls back to
the architecture's CLS for the first and last, and reads mean_sqrt_len as MEAN), several
pooling modes at once (concatenated by sentence-transformers), and a Dense module after
the pooling (vLLM applies it; aioserve does not yet). `--pooler-config` keys vLLM accepts
are taken where aioserve honours them (or they are at vLLM's default, which changes
nothing for an embedding model) and refused by name otherwise; `normalize`, removed by
vLLM for `use_activation`, is refused with vLLM's message. `dimensions` (a matryoshka
model's default embedding size) is refused at start for a model that is not matryoshka,
where vLLM refuses every request instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from aioserve.models.classifier_activation import classifier_activation
from aioserve.models.registry import (
    CLASSIFY_ARCHITECTURES,
    POOLING_ARCHITECTURES,
    native_architecture,
)

POOLING_TYPES = ("MEAN", "CLS", "LAST")
# vLLM's token-level pooling types (the token_embed / token_classify tasks).
_TOKEN_POOLING_TYPES = ("ALL", "STEP")
# The sentence-transformers module types vLLM recognizes (vllm/transformers_utils/config.py).
_ST_POOLING_MODULES = {
    "sentence_transformers.models.Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
}
_ST_NORMALIZE_MODULES = {
    "sentence_transformers.models.Normalize",
    "sentence_transformers.base.modules.normalize.Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize",
}
_ST_DENSE_MODULES = {
    "sentence_transformers.models.Dense",
    "sentence_transformers.base.modules.dense.Dense",
    "pylate.models.Dense.Dense",
}
# `--pooler-config` keys vLLM accepts that aioserve takes only at their default value
# (vLLM's), with why another value is refused.
_DEFAULT_ONLY_KEYS: dict[str, tuple[Any, str]] = {
    "tok_pooling_type": (None, "token-level pooling (token_embed) is not supported"),
    "enable_chunked_processing": (False, "chunked processing of long inputs is not supported"),
    "max_embed_len": (None, "inputs longer than --max-model-len are not supported"),
    "logit_mean": (None, "calibrating classification scores is not supported yet"),
    "logit_sigma": (None, "calibrating classification scores is not supported yet"),
    "step_tag_id": (None, "it is for reward models, which are not supported"),
    "returned_token_ids": (None, "it is for reward models, which are not supported"),
}
# Keys taken whatever their value: they change nothing for an embedding model
# (vLLM reads enable_flash_late_interaction only for late-interaction scoring).
_IGNORED_KEYS = ("enable_flash_late_interaction",)
_HONOURED_KEYS = ("task", "pooling_type", "seq_pooling_type", "use_activation", "dimensions")


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model's prompts become embeddings, or class scores.

    pooling_type: "MEAN" (the average of the prompt's rows), "CLS" (its first row) or
    "LAST" (its last row); normalize: whether the task's activation applies by default (a
    request's `use_activation` may say otherwise): for embeddings L2 normalization, for a
    classifier `activation`; dimensions: a matryoshka model's default embedding size (the
    first `dimensions` components, before normalization), None for all. task: "embed", or
    "classify" for a sequence classifier (models/bert_classifiers.py), whose head turns the
    CLS row into `num_labels` logits and whose `activation` is vLLM's for its config.
    """

    pooling_type: str
    normalize: bool
    dimensions: int | None = None
    task: str = "embed"
    num_labels: int = 0
    activation: str = ""

    @property
    def scores_pairs(self) -> bool:
        """Whether the model scores text pairs (/score, /rerank, LLM.score): an embedding
        model (cosine similarity) or a one-label classifier (a cross-encoder), as vLLM's
        scoring API is enabled."""
        return self.task == "embed" or self.num_labels == 1


def pooler_config_for(
    folder: Path | None, hf_config: PretrainedConfig, overrides: dict[str, Any] | None = None
) -> PoolerConfig:
    """The pooling of the model whose HF config is `hf_config`: `overrides`
    (`--pooler-config`), then the sentence-transformers files in `folder` (None: a model
    without a folder, e.g. `--load-format dummy` of a hub id), then the architecture's
    default. ValueError, naming the cause, for what aioserve cannot honour."""
    overrides = dict(overrides or {})
    _check_override_keys(overrides)
    pooling_type = _override_pooling_type(overrides)
    normalize = overrides.get("use_activation")
    if normalize is not None and not isinstance(normalize, bool):
        raise ValueError(f"--pooler-config use_activation must be true or false, got {normalize!r}")
    architecture = native_architecture(hf_config)
    task = "classify" if architecture in CLASSIFY_ARCHITECTURES else "embed"
    if overrides.get("task") not in (None, task):
        raise ValueError(
            f"--pooler-config task {overrides['task']!r} is not supported: this model's task "
            f"is {task!r}"
        )
    if task == "classify":
        return _classifier_pooler(hf_config, pooling_type, normalize, overrides)
    st_pooling = None if folder is None else sentence_transformers_pooling(folder)
    if st_pooling is not None:
        st_type, st_normalize = st_pooling
        pooling_type = pooling_type or st_type
        normalize = st_normalize if normalize is None else normalize
    if pooling_type is None:
        # A generative model converted to embeddings (--convert embed) pools its last
        # row, as vLLM's converted models do.
        pooling_type = POOLING_ARCHITECTURES.get(architecture, "LAST")
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=True if normalize is None else normalize,
        dimensions=_checked_dimensions(overrides.get("dimensions"), hf_config),
    )


def _classifier_pooler(
    hf_config: PretrainedConfig,
    pooling_type: str | None,
    use_activation: bool | None,
    overrides: dict[str, Any],
) -> PoolerConfig:
    """A sequence classifier's pooler: its head reads the CLS row; the activation vLLM's."""
    if pooling_type not in (None, "CLS"):
        raise ValueError(
            f"--pooler-config pooling_type {pooling_type!r}: a sequence classifier's head reads "
            "the CLS row"
        )
    if overrides.get("dimensions") is not None:
        raise ValueError("--pooler-config dimensions: a sequence classifier has no embedding")
    return PoolerConfig(
        pooling_type="CLS",
        normalize=True if use_activation is None else use_activation,
        task="classify",
        num_labels=hf_config.num_labels,
        activation=classifier_activation(hf_config),
    )


def sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool] | None:
    """(pooling type or None when the config names none, whether a Normalize module is
    listed) from a sentence-transformers folder's modules.json and its Pooling module's
    config.json; None when the folder has no modules.json or it lists no Pooling module
    (vLLM then reads neither). ValueError for a pooling or a module aioserve does not do."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    types = [module.get("type") for module in modules]
    dense = [t for t in types if t in _ST_DENSE_MODULES]
    if dense:
        raise ValueError(
            f"{modules_file} lists a {dense[0]} module after the pooling: sentence-transformers "
            "Dense projections are not supported yet"
        )
    pooling = next((m for m in modules if m.get("type") in _ST_POOLING_MODULES), None)
    if pooling is None:
        return None
    normalize = any(t in _ST_NORMALIZE_MODULES for t in types)
    pooling_file = folder / pooling.get("path", "") / "config.json"
    settings = json.loads(pooling_file.read_text()) if pooling_file.is_file() else {}
    modes = [
        value if key == "pooling_mode" else key.removeprefix("pooling_mode_")
        for key, value in settings.items()
        if (key == "pooling_mode" and isinstance(value, str))
        or (key.startswith("pooling_mode_") and value is True)
    ]
    types = {_st_pooling_type(mode, pooling_file) for mode in modes}
    if len(types) > 1:
        raise ValueError(
            f"{pooling_file} asks for several poolings at once ({', '.join(modes)}), "
            "concatenated by sentence-transformers; only one is supported"
        )
    return (types.pop() if types else None), normalize


# sentence-transformers' pooling modes (a `pooling_mode` value or a `pooling_mode_*` flag)
# as vLLM's pooling types.
_ST_POOLING_TYPES = {
    "cls": "CLS",
    "cls_token": "CLS",
    "mean": "MEAN",
    "mean_tokens": "MEAN",
    "lasttoken": "LAST",
}


def _st_pooling_type(mode: str, source: Path) -> str:
    if mode not in _ST_POOLING_TYPES:
        raise ValueError(
            f"{source} asks for {mode} pooling, which is not supported; supported: cls, mean "
            "and lasttoken (--pooler-config '{\"pooling_type\": ...}' pools otherwise)"
        )
    return _ST_POOLING_TYPES[mode]


def _check_override_keys(overrides: dict[str, Any]) -> None:
    if "normalize" in overrides:  # vLLM's own message
        raise ValueError(
            "--pooler-config: parameter `normalize` was removed; use `use_activation` instead."
        )
    known = {*_HONOURED_KEYS, *_DEFAULT_ONLY_KEYS, *_IGNORED_KEYS}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"--pooler-config has unknown keys {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))}"
        )
    refused = [
        f"{key}={overrides[key]!r} ({why})"
        for key, (default, why) in _DEFAULT_ONLY_KEYS.items()
        if key in overrides and overrides[key] != default
    ]
    if refused:
        raise ValueError(f"--pooler-config values not supported: {'; '.join(refused)}")


def _override_pooling_type(overrides: dict[str, Any]) -> str | None:
    given = {k: overrides[k] for k in ("pooling_type", "seq_pooling_type") if overrides.get(k)}
    if len(given) > 1:
        raise ValueError("--pooler-config: cannot set both `pooling_type` and `seq_pooling_type`")
    if not given:
        return None
    key, value = next(iter(given.items()))
    if value in _TOKEN_POOLING_TYPES:
        raise ValueError(
            f"--pooler-config {key} {value!r} is token-level pooling (token_embed), which is "
            f"not supported; choose one of {', '.join(POOLING_TYPES)}"
        )
    if value not in POOLING_TYPES:
        raise ValueError(
            f"--pooler-config {key} {value!r} is not a pooling type; "
            f"choose one of {', '.join(POOLING_TYPES)}"
        )
    return value


def _checked_dimensions(dimensions: Any, hf_config: PretrainedConfig) -> int | None:
    if dimensions is None:
        return None
    if isinstance(dimensions, bool) or not isinstance(dimensions, int):
        raise ValueError(f"--pooler-config dimensions must be an integer, got {dimensions!r}")
    matryoshka = getattr(hf_config, "matryoshka_dimensions", None)
    if not (matryoshka or getattr(hf_config, "is_matryoshka", False)):
        raise ValueError(
            "--pooler-config dimensions: the model does not support Matryoshka embeddings; "
            "dimensions must be unset"
        )
    size = getattr(hf_config, "embedding_size", None) or hf_config.hidden_size
    if not 1 <= dimensions <= size:
        raise ValueError(f"--pooler-config dimensions {dimensions}: the model supports 1 to {size}")
    if matryoshka and dimensions not in matryoshka:
        raise ValueError(
            f"--pooler-config dimensions {dimensions}: the model supports {matryoshka}"
        )
    return dimensions


def pool(hidden: Tensor, cu_seqlens: Tensor, pooling_type: str) -> Tensor:
    """One float32 row a prompt [B, hidden] from the packed rows hidden [T, hidden], prompt
    b owning rows cu_seqlens[b]:cu_seqlens[b+1]: their mean (summed in float32, as vLLM's
    MeanPool), the first row (CLS) or the last (LAST). Every prompt must have a row; rows
    past cu_seqlens[-1] (padding) are ignored. Nothing waits for the device."""
    if pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling type {pooling_type!r} is not one of {', '.join(POOLING_TYPES)}")
    starts = cu_seqlens[:-1].long()
    ends = cu_seqlens[1:].long()
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    num_seqs = starts.shape[0]
    # Each row's prompt: how many prompts end at or before it (num_seqs for padding rows,
    # summed into a spare row).
    rows = torch.arange(hidden.shape[0], dtype=cu_seqlens.dtype, device=hidden.device)
    owners = torch.searchsorted(cu_seqlens[1:], rows, right=True)
    sums = torch.zeros(num_seqs + 1, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, owners, hidden.float())
    return sums[:num_seqs] / (ends - starts).unsqueeze(1)
