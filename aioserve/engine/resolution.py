"""How the values a configuration leaves open are decided, for a generative or a pooling
model alike (build.py, pooling_build.py): dtype "auto", max_model_len, the arguments whose
default depends on the platform (`PlatformDefault`) and, for the batch limits, on
--performance-mode, asynchronous scheduling, whether the dense layers run on weights packed
for oneDNN; for a generative model, the batch sizes its decode steps are padded to; and
the Hugging Face hub's revisions and token (`hub_options`)."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import PretrainedConfig

from aioserve.config.arguments import argument
from aioserve.config.compilation import CompilationSettings
from aioserve.config.declaration import PlatformDefault
from aioserve.config.engine import ModelConfig
from aioserve.config.values import AUTO_FIT
from aioserve.kernels import dispatch
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.linear import onednn_packs
from aioserve.models.resolve import HubOptions, check_hub_options
from aioserve.models.rope_parameters import rope_scaling, scaled_context_length, scaling_type
from aioserve.models.sliding_windows import configured_window
from aioserve.platform import FAST_BF16_CPU_FLAGS, cpu_fast_bf16_flag, current_platform
from aioserve.runner.decode_graphs import capture_sizes

logger = logging.getLogger("aioserve")

LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"

_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def resolve_dtype(requested: str, checkpoint: Checkpoint) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    if current_platform() == "cpu":
        flag = cpu_fast_bf16_flag()
        if flag is not None:
            logger.info("dtype auto: bfloat16, which this CPU computes in hardware (%s)", flag)
            return torch.bfloat16
        logger.info(
            "dtype auto: float32, as this CPU has no bfloat16 arithmetic (neither %s)",
            " nor ".join(FAST_BF16_CPU_FLAGS),
        )
        return torch.float32
    config = checkpoint.hf_config
    stored = getattr(config, "dtype", None)
    if stored is None and "torch_dtype" in config.to_dict():
        stored = config.to_dict()["torch_dtype"]
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    if stored in (torch.bfloat16, torch.float16):
        return stored
    return torch.float16


def resolve_max_model_len(
    requested: int | None, hf_config: PretrainedConfig, disable_sliding_window: bool = False
) -> int:
    """--max-model-len as given (checked against the model's maximum context length, which
    --disable-sliding-window caps at the window, or its config's `model_max_length`), else
    that maximum."""
    derived = scaled_context_length(hf_config)
    # vLLM's meaning of --disable-sliding-window: the whole context attended, so the
    # context is capped at the window (models/sliding_windows.py).
    window = configured_window(hf_config)
    if disable_sliding_window and window and window < derived:
        derived = window
    if requested is None or requested == AUTO_FIT:  # AUTO_FIT: cut to the KV cache later
        scaling = rope_scaling(hf_config)
        if scaling_type(scaling) == "longrope":
            # vLLM's default for LongRoPE: the original context, where the short factors
            # serve (rope_parameters.choose_longrope_factors); longer only when asked.
            original = getattr(hf_config, "original_max_position_embeddings", None)
            original = original or scaling.get("original_max_position_embeddings")
            return min(derived, int(original or derived))
        return derived
    # vLLM's exception: a config's own `model_max_length`, where it says more than its
    # positions, lets a --max-model-len up to it through.
    model_max_length = getattr(hf_config, "model_max_length", None)
    if requested > derived and (model_max_length is None or requested > model_max_length):
        check_long_max_model_len(requested, derived)
    return requested


def fit_max_model_len(max_model_len: int, num_blocks: int, block_size: int) -> int:
    """--max-model-len auto (-1): the model's context `max_model_len`, or less where the KV
    cache holds less, so that one sequence of it always fits (vLLM's auto-fit)."""
    capacity = num_blocks * block_size
    if capacity >= max_model_len:
        logger.info(
            "Auto-fit max_model_len: full model context length %d fits in the KV cache (%d tokens)",
            max_model_len,
            capacity,
        )
        return max_model_len
    logger.info(
        "Auto-fit max_model_len: reduced from %d to %d to fit in the KV cache",
        max_model_len,
        capacity,
    )
    return capacity


def long_max_model_len_allowed() -> bool:
    """vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1" or "true" (any case) lets --max-model-len
    exceed the model's maximum context length."""
    return os.environ.get(LONG_MAX_MODEL_LEN_ENV, "0").strip().lower() in ("1", "true")


def check_long_max_model_len(requested: int, derived: int) -> None:
    """A --max-model-len `requested` past the model's maximum context length `derived`: a
    ValueError, as in vLLM, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN allows it; then a warning.
    The RoPE tables then cover the longer context (rope_parameters.rotary_table_length)."""
    message = (
        f"--max-model-len {requested} is larger than the model's maximum context length {derived}."
    )
    caution = (
        f"{LONG_MAX_MODEL_LEN_ENV} must be used with extreme caution. If the model uses "
        "relative position encoding (RoPE), positions past that length are rotated by angles "
        "it may not have been trained on, and its output there may degrade. A model with "
        "learned absolute position embeddings cannot go past them and is refused."
    )
    if not long_max_model_len_allowed():
        raise ValueError(
            f"{message} To allow overriding this maximum, set the env var "
            f"{LONG_MAX_MODEL_LEN_ENV}=1. {caution}"
        )
    logger.warning("%s %s", message, caution)


def resolve_async_scheduling(
    requested: bool | None, platform: str, speculating: bool = False
) -> bool:
    """--async-scheduling as given, else on for a GPU and off for the CPU; always off with
    speculative decoding, whose drafts come from the tokens of the step before (the two
    together are refused with the configuration, config/engine.py).

    On a GPU the overlap hides the host's work behind the device's (bench/host_overhead.py).
    On the CPU the host and the model step share the cores, and on a 2-core EPYC four runs
    each way at rate inf (64 requests) gave 310-365 total tok/s with overlap and 330-360
    without (bench/RESULTS.md): no gain, so the CPU keeps the simpler sequential mode,
    which also computes no token for a request that has already finished.
    """
    if speculating:
        return False
    if requested is not None:
        return requested
    return platform_default("async_scheduling", platform)


def platform_default(dest: str, platform: str, serving: bool = False) -> Any:
    """The declared default of the argument `dest` on `platform` (a `PlatformDefault`), for
    the server (`serving`) or the offline engine."""
    declared = argument(dest)
    assert declared is not None and isinstance(declared.default, PlatformDefault), dest
    return declared.default.on(platform, serving)


def batch_default(dest: str, platform: str, serving: bool, performance_mode: str) -> int:
    """The default --max-num-seqs or --max-num-batched-tokens (`dest`): the platform's,
    doubled in the throughput performance mode (vLLM 0.32's rule)."""
    value = platform_default(dest, platform, serving)
    return 2 * value if performance_mode == "throughput" else value


def resolve_decode_graph_sizes(
    requested: list[int],
    max_num_seqs: int,
    enforce_eager: bool,
    compilation: CompilationSettings,
    performance_mode: str = "balanced",
) -> list[int]:
    """The batch sizes decode steps are padded to (runner/decode_graphs.py), from
    --cuda-graph-sizes (`requested`) or --compilation-config's sizes: none under
    --enforce-eager or cudagraph_mode NONE; on the CPU, which captures no graph, only
    those asked for. The interactivity performance mode makes the default list finer."""
    if enforce_eager or not compilation.captures_graphs:
        return []
    if compilation.cudagraph_capture_sizes is not None:
        # Exactly these, where one --cuda-graph-sizes value N stands for several.
        return [size for size in compilation.cudagraph_capture_sizes if size <= max_num_seqs]
    if compilation.max_capture_size is not None:
        requested = [compilation.max_capture_size]
    if current_platform() == "cpu" and not requested:
        return []
    return capture_sizes(requested, max_num_seqs, fine_grained=performance_mode == "interactivity")


def resolve_packed_weights(dtype: torch.dtype) -> bool:
    """Whether the dense products run oneDNN on weights packed once (models/linear.py): on a
    CPU with bfloat16 arithmetic, for a bfloat16 model, outside batch-invariant mode (whose
    products go in tiles of one shape)."""
    return current_platform() == "cpu" and onednn_packs(dtype) and not dispatch.batch_invariant()


def hub_options(model: ModelConfig) -> HubOptions:
    """--revision, --tokenizer-revision and --hf-token for the downloads; a ValueError naming
    the flag where one would select nothing (models/resolve.py's check_hub_options)."""
    hub = HubOptions(model.revision, model.tokenizer_revision, model.hf_token)
    tokenizer = None if model.skip_tokenizer_init else model.tokenizer
    check_hub_options(hub, model.model, tokenizer, model.hf_config_path)
    return hub
