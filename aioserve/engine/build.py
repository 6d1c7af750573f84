"""Assemble an engine from its configuration: settings resolved, model loaded, KV pool sized.

The configuration leaves some values to the engine (dtype "auto", and the fields that
aioserve.config.engine leaves None); they are decided here, once, with the model's config
and the device at hand (the rules a pooling model shares are resolution.py's; a pooling
model's engine is pooling_build.py's):

- dtype "auto": on the CPU bfloat16 where it runs in hardware (AMX or AVX-512-BF16, as
  vLLM's CPU backend chooses) and float32 elsewhere (half precision runs several times
  slower there), where the compiled single-row products (decode at one stream) read
  bfloat16 copies of the weights, the float32 weights rounded to the same values
  (models/linear.py); on a GPU the checkpoint's dtype, float32 checkpoints running in
  float16 as in vLLM; where the dense products then run on packed bfloat16 weights, a
  GGUF checkpoint's 4-bit layers are also kept as stored for steps of a few rows (on a
  GPU they are kept as stored only, for the Triton kernels); an AWQ or GPTQ checkpoint's
  layers are kept as stored on a GPU and dequantized to the model's dtype on the CPU, where
  those without act-order are also kept as GGUF's are, for steps of a few rows; an FP8
  checkpoint's likewise, kept on a GPU and dequantized on the CPU, and `--quantization fp8`
  quantizes a 16-bit checkpoint's decoder layers at load, on a GPU only;
- max_model_len: the model's max_position_embeddings, stretched by linear, dynamic or
  YaRN RoPE scaling as vLLM stretches it (models/rope_parameters.py), capped by a sliding
  window only under --disable-sliding-window, which attends the whole context (vLLM's
  meaning: models/sliding_windows.py); for LongRoPE, as vLLM, its
  original_max_position_embeddings unless --max-model-len asks for more;
- max_num_seqs, max_num_batched_tokens and asynchronous scheduling: their declared
  `PlatformDefault` (aioserve/config/arguments.py) for this device and use (`serve` on the
  CPU takes vLLM's server defaults, 128 sequences and 2,048 tokens; the offline engine 256
  and 4,096), doubled by --performance-mode throughput; without chunked prefill the token
  budget is at least max_model_len;
- KV blocks: --num-gpu-blocks-override, else VLLM_CPU_KVCACHE_SPACE on the CPU, else
  what --gpu-memory-utilization leaves after the weights and a profiled peak step.

`EngineSettings.load_report` then says what was loaded and what it holds (load_report.py),
for the server's ready line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from aioserve.config.engine import EngineConfig
from aioserve.config.values import AUTO_FIT
from aioserve.engine.block_hashing import check_hash_algorithm
from aioserve.engine.kv_events import check_publisher_packages
from aioserve.engine.load_report import build_load_report, kv_cache_sized_by
from aioserve.engine.lora_requests import LoRAAdapterCache
from aioserve.engine.multimodal import image_processor_for
from aioserve.engine.partial_prefills import partial_prefill_limits
from aioserve.engine.pooling_build import build_pooling_engine, serves_pooling
from aioserve.engine.resolution import (
    batch_default,
    fit_max_model_len,
    hub_options,
    platform_default,
    resolve_async_scheduling,
    resolve_decode_graph_sizes,
    resolve_dtype,
    resolve_max_model_len,
    resolve_packed_weights,
)
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler_limits import resolve_scheduler_limits
from aioserve.engine.served_weights import load_served_model
from aioserve.engine.settings import EngineParts, EngineSettings
from aioserve.engine.step_observation import engine_observability
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from aioserve.engine.thinking_markers import thinking_markers
from aioserve.kernels import dispatch
from aioserve.logits_processor import ProcessorConfig, build_processors, load_processor_classes
from aioserve.models.checkpoint import Checkpoint, open_checkpoint
from aioserve.models.lora_adapter import read_lora_adapter
from aioserve.models.moe import num_experts
from aioserve.models.rope_parameters import fit_rope_to_context
from aioserve.models.sliding_windows import disable_sliding_window
from aioserve.platform import (
    current_platform,
    device,
    e4m3_missing,
    is_gpu,
)
from aioserve.runner.kv_memory import kv_cache_torch_dtype, num_kv_blocks
from aioserve.runner.model_runner import ModelRunner

logger = logging.getLogger("aioserve")

_DEFAULT_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _batch_invariant_step(compiled: bool) -> bool:
    """Say how VLLM_BATCH_INVARIANT=1 holds here; return whether the step compiles."""
    if current_platform() != "cpu":
        logger.info(
            "VLLM_BATCH_INVARIANT=1: the dense products run one fixed-tile Triton GEMM "
            "(kernels/dense_linear.py) instead of cuBLAS/hipBLASLt, the quantized ones their "
            "widest tile without a split of K, and each decode's attention splits by its "
            "length alone, so a row's result does not depend on its batch"
        )
        return compiled
    if compiled:
        logger.info(
            "VLLM_BATCH_INVARIANT=1: the model step runs eagerly, its dense products in tiles "
            "of one shape and each decode's attention on its own, so a row's result does not "
            "depend on its batch"
        )
    return False


def resolve_row_weight_dtype(
    requested: str, dtype: torch.dtype, *, compiled: bool
) -> torch.dtype | None:
    """The dtype of the weight copies that single-row products read, or None for none.

    Only dtype auto on a CPU that computes in float32 has them: a one-stream decode is
    bound by reading the weights, and bfloat16 halves that. Asked for float32, a user gets
    the checkpoint's float32 values; eagerly, one row goes through MKL, which reads float32.
    """
    if requested != "auto" or dtype != torch.float32 or current_platform() != "cpu":
        return None
    if not compiled:
        return None
    logger.info(
        "dtype auto: single-row products read bfloat16 copies of the weights, half the "
        "bytes; the float32 weights are rounded to the same values (--dtype float32 keeps them)"
    )
    return torch.bfloat16


def check_long_prefill_token_threshold(threshold: int, max_model_len: int) -> None:
    """vLLM's limit on --long-prefill-token-threshold: at most the context length."""
    if threshold > max_model_len:
        raise ValueError(
            f"--long-prefill-token-threshold ({threshold}) cannot be greater than the "
            f"max_model_len ({max_model_len})."
        )


def check_device(requested: str) -> None:
    """--device: auto, or the device this machine computes on (torch's name for it: cuda
    on an NVIDIA or AMD GPU), which aioserve finds itself as vLLM now does."""
    if requested == "auto":
        return
    found = "cpu" if current_platform() == "cpu" else "cuda"
    if requested != found:
        raise ValueError(
            f"--device {requested}: this machine computes on {found}, which aioserve finds "
            f"itself; leave --device out (or give auto or {found})"
        )


def check_quantize_to_fp8(checkpoint: Checkpoint) -> None:
    """`--quantization fp8` on a 16-bit checkpoint needs the GPU's FP8 kernels."""
    if checkpoint.quantize_to_fp8 and not is_gpu():
        raise ValueError(
            "--quantization fp8 quantizes a 16-bit model's weights at load for the FP8 "
            "kernels of a GPU; the CPU has none worth using (torch's took ~40x the time of "
            "bfloat16 here), so it is not supported there: leave it out (an FP8 checkpoint "
            "does load on the CPU, dequantized)"
        )
    missing = e4m3_missing()
    if checkpoint.quantize_to_fp8 and missing is not None:
        raise ValueError(f"--quantization fp8 cannot run here: {missing}; leave it out")


def check_moe_weights(checkpoint: Checkpoint) -> None:
    """A mixture-of-experts model's experts are held in 16 or 32 bits (models/moe.py), or
    kept as stored where a checkpoint's FP8 layers are and its scales are block-wise
    (models/moe_fp8_weights.py). An FP8 checkpoint's experts are dequantized at load where
    its dense layers are (the CPU, an NVIDIA GPU before sm_89); other quantized checkpoints
    of one are refused by name rather than dequantized whole."""
    if not num_experts(checkpoint.hf_config):
        return
    architecture = (getattr(checkpoint.hf_config, "architectures", None) or ["?"])[0]
    if checkpoint.quantize_to_fp8:
        raise ValueError(
            f"--quantization fp8 is not supported for mixture-of-experts models "
            f"({architecture}) yet: leave it out"
        )
    if checkpoint.load_format == "gguf":
        method = "a GGUF file"
    elif checkpoint.int4_scheme is not None:
        method = f"{checkpoint.int4_scheme.method.upper()} weights"
    elif checkpoint.fp8_scheme is not None:
        kept_as_stored = is_gpu() and e4m3_missing() is None  # as resolve_fp8_weights
        if checkpoint.fp8_scheme.block is not None or not kept_as_stored:
            return
        method = "per-tensor or per-channel FP8 weights on a GPU (block-wise ones are served)"
    elif checkpoint.int8_scheme is not None:
        method = "INT8 weights"
    else:
        return
    raise ValueError(
        f"mixture-of-experts models ({architecture}) with {method} are not supported yet: "
        "serve a 16-bit (bfloat16, float16 or float32) checkpoint of this model"
    )


def _generation_defaults(config: EngineConfig, checkpoint: Checkpoint) -> dict:
    source = config.model.generation_config
    if source == "vllm":
        values: dict = {}
    elif source == "auto":
        values = dict(checkpoint.generation_config)
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {source}: no generation_config.json in that folder"
            )
        values = json.loads(path.read_text())
    values.update(config.model.override_generation_config or {})
    return values


def _eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | None, generation: dict, hf_config
) -> frozenset[int]:
    ids: set[int] = set()
    for source in (generation.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def build_engine(config: EngineConfig) -> EngineParts:
    model_cfg, cache_cfg, sched_cfg = config.model, config.cache, config.scheduler
    check_device(config.device.device)
    check_hash_algorithm(cache_cfg.prefix_caching_hash_algo)
    check_publisher_packages(cache_cfg.kv_events_config)
    checkpoint = open_checkpoint(
        model_cfg.model,
        load_format=config.load.load_format,
        hf_overrides=model_cfg.hf_overrides,
        download_dir=config.load.download_dir,
        trust_remote_code=model_cfg.trust_remote_code,
        quantization=model_cfg.quantization,
        hf_config_path=model_cfg.hf_config_path,
        rope_scaling=model_cfg.rope_scaling,
        rope_theta=model_cfg.rope_theta,
        ignore_patterns=config.load.ignore_patterns,
        pt_load_map_location=config.load.pt_load_map_location,
        hub=hub_options(model_cfg),
    )
    check_quantize_to_fp8(checkpoint)
    check_moe_weights(checkpoint)
    performance_mode = config.compilation.performance_mode
    if performance_mode != "balanced":
        logger.info("Performance mode set to '%s'.", performance_mode)
    # An image model's language model's config (the object inside its config, so that
    # what is fitted to the context below is what its decoder is built from).
    hf_config = checkpoint.hf_config.get_text_config()
    tokenizer = None
    if not model_cfg.skip_tokenizer_init:
        tokenizer = checkpoint.load_tokenizer(model_cfg.tokenizer, model_cfg.tokenizer_mode)

    if serves_pooling(model_cfg, checkpoint):
        if config.lora.enable_lora:
            raise ValueError("--enable-lora: LoRA adapters on pooling models are not supported yet")
        if config.speculative.speculative_config is not None:
            raise ValueError("--speculative-config: a pooling model samples no tokens to draft")
        if model_cfg.logits_processors:
            raise ValueError(
                "--logits-processors: Pooling models do not support custom logits processors."
            )
        if model_cfg.enable_sleep_mode:
            raise ValueError("--enable-sleep-mode: pooling models do not sleep yet")
        return build_pooling_engine(config, checkpoint, tokenizer)

    dtype = resolve_dtype(model_cfg.dtype, checkpoint)
    dev = device()
    max_model_len = resolve_max_model_len(
        model_cfg.max_model_len, hf_config, model_cfg.disable_sliding_window
    )
    if model_cfg.disable_sliding_window:
        disable_sliding_window(hf_config)
    chunked = sched_cfg.enable_chunked_prefill
    platform = current_platform()
    block_size = cache_cfg.block_size or platform_default("block_size", platform)
    max_tokens = sched_cfg.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = batch_default(
            "max_num_batched_tokens", platform, config.serving, performance_mode
        )
        if not chunked:
            max_tokens = max(max_tokens, max_model_len)
    elif not chunked and max_tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens ({max_tokens}) is smaller than --max-model-len ({max_model_len}): "
            "without chunked prefill a whole prompt must fit in one step; enable chunked prefill "
            "or raise --max-num-batched-tokens"
        )
    check_long_prefill_token_threshold(sched_cfg.long_prefill_token_threshold, max_model_len)
    partial_prefills = partial_prefill_limits(
        sched_cfg.max_num_partial_prefills,
        sched_cfg.max_long_partial_prefills,
        sched_cfg.long_prefill_token_threshold,
        max_model_len,
    )
    if partial_prefills is not None:
        logger.info(
            "concurrent partial prefills: up to %d prompts at once, %d of them longer than "
            "%d tokens",
            partial_prefills.max_num_partial_prefills,
            partial_prefills.max_long_partial_prefills,
            partial_prefills.long_prompt_threshold,
        )
    fit_rope_to_context(hf_config, max_model_len)
    max_num_seqs = sched_cfg.max_num_seqs
    if max_num_seqs is None:
        max_num_seqs = batch_default("max_num_seqs", platform, config.serving, performance_mode)
    limits = resolve_scheduler_limits(sched_cfg, max_tokens, max_num_seqs, max_model_len, chunked)

    def load_weights() -> nn.Module:
        """The checkpoint's model in its served form (again for a level-2 wake)."""
        return load_served_model(checkpoint, config, dtype, dev)

    model = load_weights()
    compiles = getattr(model, "compiles", True)  # False: the Transformers backend's
    if not compiles and config.lora.enable_lora:
        raise ValueError("--enable-lora: the Transformers backend (--model-impl) has no LoRA yet")
    kv_dtype = kv_cache_torch_dtype(cache_cfg.kv_cache_dtype, dtype)
    num_blocks = num_kv_blocks(
        model,
        block_size=block_size,
        dtype=kv_dtype,
        num_blocks_override=cache_cfg.num_gpu_blocks_override,
        cpu_kvcache_space_bytes=cache_cfg.cpu_kvcache_space_bytes,
        kv_cache_memory_bytes=cache_cfg.kv_cache_memory_bytes,
        gpu_memory_utilization=cache_cfg.gpu_memory_utilization,
        max_num_batched_tokens=max_tokens,
        max_logits_rows=max_num_seqs * (1 + num_speculative_tokens(config)),
    )
    if model_cfg.max_model_len == AUTO_FIT:
        max_model_len = fit_max_model_len(max_model_len, num_blocks, block_size)
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens), "
            f"fewer than one sequence of --max-model-len {max_model_len}; give the cache more memory "
            "(VLLM_CPU_KVCACHE_SPACE, --gpu-memory-utilization or --num-gpu-blocks-override) "
            "or lower --max-model-len"
        )
    lora_cfg = config.lora
    compilation = config.compilation.compilation_config
    compiled = (
        compiles and platform == "cpu" and not model_cfg.enforce_eager and compilation.compiles
    )
    if dispatch.batch_invariant():
        compiled = _batch_invariant_step(compiled)
    lora_dtype = dtype if lora_cfg.lora_dtype == "auto" else getattr(torch, lora_cfg.lora_dtype)
    processor_classes = load_processor_classes(model_cfg.logits_processors or ())
    markers = thinking_markers(config.decoding, tokenizer)
    runner = ModelRunner(
        model,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        dtype=dtype,
        device=dev,
        compile_model=compiled,
        row_weight_dtype=resolve_row_weight_dtype(model_cfg.dtype, dtype, compiled=compiled),
        packed_weights=resolve_packed_weights(dtype),
        # A replayed graph would skip LoRA's op (models/lora_op.py): none with LoRA.
        decode_graph_sizes=resolve_decode_graph_sizes(
            sched_cfg.cuda_graph_sizes,
            max_num_seqs,
            model_cfg.enforce_eager or lora_cfg.enable_lora or not compiles,
            compilation,
            performance_mode,
        ),
        max_seq_len_to_capture=model_cfg.max_seq_len_to_capture,
        kv_cache_dtype=kv_dtype,
        calculate_kv_scales=cache_cfg.calculate_kv_scales,
        logprobs_mode=model_cfg.logprobs_mode,
        lora_slots=(lora_cfg.max_loras, lora_cfg.max_lora_rank, lora_dtype)
        if lora_cfg.enable_lora
        else None,
        logits_processors=build_processors(
            processor_classes,
            ProcessorConfig(
                model_cfg.model, hf_config.vocab_size, max_num_seqs, max_model_len, config
            ),
            dev,
        ),
        thinking_markers=markers,
    )
    runner.warm_up()
    lora_adapters = None
    if lora_cfg.enable_lora:
        lora_adapters = LoRAAdapterCache(
            lambda path: read_lora_adapter(path, model, lora_cfg.max_lora_rank, lora_dtype),
            lora_cfg.max_cpu_loras or lora_cfg.max_loras,
        )
        logger.info(
            "LoRA: %d adapter slots of rank %d (%.0f MiB), up to %d adapters in host memory",
            lora_cfg.max_loras,
            lora_cfg.max_lora_rank,
            runner.lora.nbytes / 2**20,
            lora_adapters.capacity,
        )

    generation = _generation_defaults(config, checkpoint)
    default_sampling = {k: generation[k] for k in _DEFAULT_SAMPLING_KEYS if k in generation}
    served = model_cfg.served_model_name or [model_cfg.model]
    speculation = config.speculative.speculative_config
    settings = EngineSettings(
        model_name=model_cfg.model,
        served_model_names=list(served),
        dtype=dtype,
        device=dev,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=cache_cfg.enable_prefix_caching,
        prefix_caching_hash_algo=cache_cfg.prefix_caching_hash_algo,
        kv_events=cache_cfg.kv_events_config,
        enable_prompt_embeds=model_cfg.enable_prompt_embeds,
        limit_mm_per_prompt=model_cfg.limit_mm_per_prompt,
        allowed_local_media_path=model_cfg.allowed_local_media_path,
        enable_sleep_mode=model_cfg.enable_sleep_mode,
        hidden_size=hf_config.hidden_size,
        scheduling_policy=sched_cfg.scheduling_policy,
        async_scheduling=resolve_async_scheduling(
            sched_cfg.async_scheduling, platform, speculation is not None
        ),
        speculation=speculation,
        max_logprobs=model_cfg.max_logprobs,
        seed=model_cfg.seed,
        eos_token_ids=_eos_token_ids(tokenizer, generation, hf_config),
        tokenizer_eos_token_id=None if tokenizer is None else tokenizer.eos_token_id,
        default_sampling=default_sampling,
        max_new_tokens_cap=generation.get("max_new_tokens"),
        max_num_queued_reqs=sched_cfg.max_num_queued_reqs,
        long_prefill_token_threshold=sched_cfg.long_prefill_token_threshold,
        partial_prefills=partial_prefills,
        scheduler_delay_factor=sched_cfg.scheduler_delay_factor,
        scheduler_limits=limits,
        collect_model_forward_time=config.observability.collect_model_forward_time,
        collect_model_execute_time=config.observability.collect_model_execute_time,
        max_num_queued_tokens=sched_cfg.max_num_queued_tokens,
        reasoning_parser=config.decoding.reasoning_parser,
        structured_outputs=StructuredOutputsConfig.from_decoding(config.decoding),
        load_report=build_load_report(
            model_cfg.model, checkpoint, runner, kv_cache_sized_by(cache_cfg, platform)
        ),
        max_loras=lora_cfg.max_loras if lora_cfg.enable_lora else 0,
        logits_processor_classes=tuple(processor_classes),
        thinking_budgets=markers is not None,
        stream_interval=sched_cfg.stream_interval,
        observability=engine_observability(
            config, checkpoint, dtype, kv_dtype, runner.graph_settings
        ),
    )
    logger.info(
        "engine ready: %s, %s on %s, %d KV blocks of %d tokens, max_model_len %d, "
        "up to %d sequences and %d tokens a step, asynchronous scheduling %s",
        model_cfg.model,
        str(dtype).removeprefix("torch."),
        dev,
        num_blocks,
        block_size,
        max_model_len,
        max_num_seqs,
        max_tokens,
        "on" if settings.async_scheduling else "off",
    )
    if speculation is not None:
        logger.info("speculative decoding: %s", speculation.describe())
    return EngineParts(
        settings=settings,
        tokenizer=tokenizer,
        runner=runner,
        hf_config=hf_config,
        lora_adapters=lora_adapters,
        load_weights=load_weights,
        image_processor=image_processor_for(checkpoint, model),
    )


def num_speculative_tokens(config: EngineConfig) -> int:
    """The most drafts a sequence checks in a step (0 without speculative decoding)."""
    speculation = config.speculative.speculative_config
    return 0 if speculation is None else speculation.num_speculative_tokens


def default_sampling_params(settings: EngineSettings) -> SamplingParams:
    """vLLM's `get_default_sampling_params`: the generation config's defaults, if any."""
    return SamplingParams(**settings.default_sampling)
