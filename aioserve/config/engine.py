"""The engine's configuration, built from the declarations in `aioserve.config.arguments`.

`EngineConfig` groups the values as vLLM groups them (ModelConfig, LoadConfig, CacheConfig,
SchedulerConfig, DecodingConfig, ...); each field is one supported argument of that group,
named by its `dest` (a test checks that fields and declarations match). The command line
(`engine_config_from_args`) and the Python API (`engine_config_from_kwargs`, behind
`LLM(**kwargs)`) go through the same checks, so both give the same error for the same bad
value: a `ConfigError` naming the flag (`--max-num-seqs must be at least 1, got 0`) or the
keyword (`max_num_seqs must be ...`). Every problem of one command line is reported at
once, unsupported vLLM arguments first: setting one, even to vLLM's default, is refused;
only untouched arguments are harmless.

Unset arguments take their declared default. Three stay None for the engine to decide
(engine/build.py): max_model_len (the model's limit), quantization (the checkpoint's), and
the platform defaults (`PlatformDefault`: block_size, max_num_seqs,
max_num_batched_tokens, async_scheduling).

Besides arguments, the CPU KV-cache size comes from vLLM's environment variable
VLLM_CPU_KVCACHE_SPACE (GiB, default 4), resolved into `CacheConfig.cpu_kvcache_space_bytes`,
and VLLM_TORCH_PROFILER_DIR where --profiler-config names no profiler (config/profiler.py).
The logging arguments stay as given: their environment variables are read where logging is
set up (aioserve/log_setup.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioserve.config.arguments import (
    ARGUMENTS,
    CPU_KVCACHE_SPACE_ENV,
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    argument,
)
from aioserve.config.compilation import CompilationSettings, with_capture_flags
from aioserve.config.declaration import ConfigError, checked_values
from aioserve.config.kv_events import KVEventsSettings
from aioserve.config.optimization import DEFAULT_OPTIMIZATION_LEVEL, with_optimization_level
from aioserve.config.profiler import ProfilerSettings, profiler_settings
from aioserve.config.speculative import SHORTHANDS, NgramSpeculation, with_shorthands

logger = logging.getLogger("aioserve.config")


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str  # the model when --tokenizer is not given
    tokenizer_mode: str
    trust_remote_code: bool
    dtype: str
    seed: int
    max_model_len: int | None  # None: the model's limit
    quantization: str | None  # None: the checkpoint's
    enforce_eager: bool
    max_seq_len_to_capture: int
    max_logprobs: int
    logprobs_mode: str  # what logprobs report (kernels/sampling LOGPROBS_MODES)
    generation_config: str
    override_generation_config: dict[str, Any]
    hf_overrides: dict[str, Any]
    hf_config_path: str | None  # None: the model's own config
    rope_scaling: dict[str, Any]  # {}: the model's own
    rope_theta: float | None  # None: the model's own
    disable_sliding_window: bool
    served_model_name: list[str] | None
    skip_tokenizer_init: bool
    enable_prompt_embeds: bool = False  # prompts may come as embeddings (prompt_embeds.py)
    enable_sleep_mode: bool = False  # sleep may free memory (engine/sleep.py)
    runner: str = "auto"  # generate, pooling, or auto: the architecture's
    convert: str = "auto"
    task: str = "auto"  # vLLM's deprecated spelling of the runner
    override_pooler_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    logits_processors: tuple[Any, ...] | None = None  # classes or 'module:Class' names
    disable_cascade_attn: bool = True  # always: aioserve has no cascade attention
    model_impl: str = "auto"  # models/registry.py MODEL_IMPLS
    revision: str | None = None  # of a hub model (models/resolve.py: HubOptions)
    tokenizer_revision: str | None = None  # None: --revision's, for a tokenizer from the hub
    hf_token: str | bool | None = dataclasses.field(default=None, repr=False)  # never shown
    limit_mm_per_prompt: dict[str, int] = dataclasses.field(default_factory=dict)
    allowed_local_media_path: str = ""  # "": no file:// media (config/multimodal.py)


@dataclass(frozen=True)
class LoadConfig:
    load_format: str
    download_dir: str | None
    use_tqdm_on_load: bool = True  # the weights' progress bar (models/loader.py)
    # weight files skipped (models/loaders/hf_folder.py); vLLM's default
    ignore_patterns: list[str] = dataclasses.field(default_factory=lambda: ["original/**/*"])
    pt_load_map_location: str | dict[str, str] = "cpu"  # torch.load's, for .bin/.pt weights


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None  # None: the platform default
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool
    cpu_kvcache_space_bytes: int  # VLLM_CPU_KVCACHE_SPACE's, else --kv-cache-memory-bytes
    kv_cache_dtype: str = "auto"  # the model's dtype; or fp8 (= fp8_e4m3), fp8_e5m2
    calculate_kv_scales: bool = False  # an fp8 cache's scales from the first step
    prefix_caching_hash_algo: str = "sha256"  # how full blocks are keyed (block_hashing.py)
    kv_cache_memory_bytes: int | None = None  # the KV pool's size; None: from the device
    kv_events_config: KVEventsSettings | None = None  # --kv-events-config (config/kv_events.py)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None  # None: the platform default
    max_num_batched_tokens: int | None  # None: the platform default
    enable_chunked_prefill: bool
    scheduling_policy: str
    async_scheduling: bool | None  # None: the platform default
    cuda_graph_sizes: list[int]  # []: the platform default (decode_graphs.capture_sizes)
    max_num_queued_reqs: int | None  # None: no limit (load_shedding.py)
    max_num_queued_tokens: int | None
    long_prefill_token_threshold: int  # 0: no cap on one sequence's tokens a step
    max_num_partial_prefills: int = 1  # prompts partly prefilled at once (partial_prefills.py)
    max_long_partial_prefills: int = 1  # of them, long ones
    stream_interval: int = 1  # tokens a streamed chunk gathers (output_processor.py)
    scheduler_delay_factor: float = 0.0  # prompts held back while requests run (prompt_delay.py)
    preemption_mode: str | None = None  # recompute, the only way aioserve preempts
    # vLLM 0.32's (engine/scheduler_limits.py)
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    max_num_active_seqs: int | None = None  # None: max_num_seqs
    long_prefill_token_threshold_adaptive: bool = False
    scheduler_reserve_full_isl: bool = True  # admission checks the whole prompt fits
    watermark: float = 0.0  # fraction of KV blocks kept free when admitting


@dataclass(frozen=True)
class ObservabilityConfig:
    # model, worker, all: the step times added to request spans (engine/step_timing.py)
    collect_detailed_traces: list[str] | None = None
    kv_cache_metrics: bool = False  # engine/kv_residency.py
    kv_cache_metrics_sample: float = 0.01
    cudagraph_metrics: bool = False  # runner/cudagraph_stats.py
    enable_mfu_metrics: bool = False  # engine/step_perf.py
    enable_logging_iteration_details: bool = False  # engine/step_observation.py

    @property
    def collect_model_forward_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "model" in modules or "all" in modules

    @property
    def collect_model_execute_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "worker" in modules or "all" in modules


@dataclass(frozen=True)
class DecodingConfig:
    reasoning_parser: str  # "": none
    guided_decoding_backend: str
    guided_decoding_disable_fallback: bool
    guided_decoding_disable_any_whitespace: bool
    guided_decoding_disable_additional_properties: bool
    structured_outputs_config: dict[str, Any]  # wins over the four above where it sets a key
    reasoning_config: dict[str, str]  # --reasoning-config's keys: the markers of a thought


@dataclass(frozen=True)
class SpeculativeConfig:
    speculative_config: NgramSpeculation | None  # None: no speculative decoding
    spec_method: str | None = None  # vLLM 0.32's shorthands, folded into the above
    spec_model: str | None = None
    spec_tokens: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """One device, one process: each value is the one aioserve accepts (values.one_process)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None or "uni"


@dataclass(frozen=True)
class DeviceConfig:
    device: str  # auto, or the device the machine computes on (checked by engine/build.py)


@dataclass(frozen=True)
class CompilationConfig:
    # with the two below and the optimization level's defaults folded in
    compilation_config: CompilationSettings
    cudagraph_capture_sizes: list[int] | None = None  # vLLM 0.32's shorthands
    max_cudagraph_capture_size: int | None = None
    optimization_level: int = DEFAULT_OPTIMIZATION_LEVEL  # config/optimization.py
    performance_mode: str = "balanced"  # the batch defaults and decode sizes it tunes


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    lora_dtype: str  # auto: the model's
    max_cpu_loras: int | None  # None: max_loras


@dataclass(frozen=True)
class LoggingConfig:
    """The logging arguments as given (aioserve/log_setup.py adds the environment's)."""

    logging_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # keys given
    log_level: str | None = None  # wins over logging_config's log_level
    log_config_file: str | None = None  # wins over its pylogging_config_file

    @property
    def given(self) -> bool:
        return (
            bool(self.logging_config)
            or self.log_level is not None
            or (self.log_config_file is not None)
        )


@dataclass(frozen=True)
class ProfilerConfig:
    # the torch profiler of /start_profile and /stop_profile; None: none (config/profiler.py)
    profiler_config: ProfilerSettings | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    decoding: DecodingConfig
    lora: LoRAConfig
    speculative: SpeculativeConfig = SpeculativeConfig(None)
    compilation: CompilationConfig = CompilationConfig(CompilationSettings())
    parallel: ParallelConfig = ParallelConfig()
    device: DeviceConfig = DeviceConfig("auto")
    observability: ObservabilityConfig = ObservabilityConfig()
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    profiler: ProfilerConfig = ProfilerConfig()
    # For `serve` (vLLM's OPENAI_API_SERVER usage context), not the offline engine: some
    # platform defaults differ between the two (PlatformDefault.cpu_server).
    serving: bool = False


def cpu_kvcache_space_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The CPU KV-cache size that VLLM_CPU_KVCACHE_SPACE asks for (GiB, default 4)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CPU_KVCACHE_SPACE_ENV)
    if raw is None:
        return int(DEFAULT_CPU_KVCACHE_SPACE_GIB * 2**30)
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ConfigError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, got {raw!r}")
    return int(gib * 2**30)


def _build(values: dict[str, Any], serving: bool = False, keywords: bool = False) -> EngineConfig:
    """The EngineConfig from the checked values (dest -> value) of the set arguments; errors
    name keywords rather than flags with `keywords`.

    Values of arguments that are not EngineConfig fields (the Frontend ones) are left out.
    """
    fields = {
        a.dest: values[a.dest] if a.dest in values else a.check(None, a.flag)
        for a in ARGUMENTS
        if a.supported
    }
    if fields["tokenizer"] is None:
        fields["tokenizer"] = fields["model"]
    if values.get("tokens_only") and not fields["skip_tokenizer_init"]:
        fields["skip_tokenizer_init"] = True  # vLLM's create_engine_config does the same
        logger.info("Skipping tokenizer initialization for tokens-only mode.")
    fields["cpu_kvcache_space_bytes"] = cpu_kvcache_space_bytes()
    if fields["kv_cache_memory_bytes"] is not None and CPU_KVCACHE_SPACE_ENV not in os.environ:
        # vLLM 0.32's CPU platform: the legacy variable, when set, wins over the flag.
        fields["cpu_kvcache_space_bytes"] = fields["kv_cache_memory_bytes"]

    def section(cls):
        return cls(**{field.name: fields[field.name] for field in dataclasses.fields(cls)})

    fields["profiler_config"] = profiler_settings(fields["profiler_config"])
    scheduler = _checked_scheduler(section(SchedulerConfig))
    model = section(ModelConfig)
    return EngineConfig(
        model=model,
        load=section(LoadConfig),
        cache=_checked_cache(section(CacheConfig), keywords),
        scheduler=scheduler,
        decoding=section(DecodingConfig),
        lora=_checked_lora(section(LoRAConfig)),
        speculative=_checked_speculative(section(SpeculativeConfig), scheduler, model, keywords),
        compilation=_checked_compilation(section(CompilationConfig), scheduler),
        device=section(DeviceConfig),
        parallel=section(ParallelConfig),
        observability=_checked_observability(section(ObservabilityConfig), fields),
        logging=_checked_logging(section(LoggingConfig)),
        profiler=section(ProfilerConfig),
        serving=serving,
    )


def _checked_cache(cache: CacheConfig, keywords: bool) -> CacheConfig:
    """KV-cache events are the prefix cache's: without it no block is ever stored. vLLM
    warns and publishes nothing; refused here, as a setting that would be ignored."""
    events = cache.kv_events_config
    if events is not None and events.enable_kv_cache_events and not cache.enable_prefix_caching:
        flag, caching = (
            ("kv_events_config", "enable_prefix_caching=False")
            if keywords
            else ("--kv-events-config", "--no-enable-prefix-caching")
        )
        raise ConfigError(
            f"{flag}: enable_kv_cache_events needs prefix caching, which {caching} turns off"
        )
    return cache


def _checked_observability(
    observability: ObservabilityConfig, fields: dict[str, Any]
) -> ObservabilityConfig:
    """vLLM's rule: the detailed traces go into the request spans, which need an endpoint
    (a server's flag: the offline engine sends no traces)."""
    if observability.collect_detailed_traces and fields["otlp_traces_endpoint"] is None:
        raise ConfigError(
            "--collect-detailed-traces requires `--otlp-traces-endpoint` to be set (its "
            "times go into the request spans sent there)"
        )
    return observability


def _checked_logging(logging: LoggingConfig) -> LoggingConfig:
    """vLLM's rule: a dictConfig file needs logging configured (checked again against the
    environment when logging is set up)."""
    if logging.logging_config.get("configure_logging") is False:
        if logging.log_config_file is not None:
            given = "--log-config-file"
        elif logging.logging_config.get("pylogging_config_file") is not None:
            given = "--logging-config.pylogging_config_file"
        else:
            return logging
        raise ConfigError(
            f"{given} needs logging to be configured, but --logging-config.configure_logging "
            "is false"
        )
    return logging


def _checked_scheduler(scheduler: SchedulerConfig) -> SchedulerConfig:
    """vLLM's rules on the partial-prefill arguments and on --max-num-active-seqs, in its
    words with the flags named (the platform's default --max-num-seqs is checked once the
    engine knows it: engine/scheduler_limits.py)."""
    num, long = scheduler.max_num_partial_prefills, scheduler.max_long_partial_prefills
    if num < 1:
        raise ConfigError(f"--max-num-partial-prefills ({num}) must be greater than or equal to 1.")
    if num > 1 and not scheduler.enable_chunked_prefill:
        raise ConfigError("Chunked prefill must be enabled to set --max-num-partial-prefills > 1.")
    if not 1 <= long <= num:
        raise ConfigError(
            f"--max-long-partial-prefills ({long}) must be greater than or equal to 1 and less "
            f"than or equal to --max-num-partial-prefills ({num})."
        )
    active, seqs = scheduler.max_num_active_seqs, scheduler.max_num_seqs
    if active is not None and seqs is not None and active > seqs:
        raise ConfigError(
            f"--max-num-active-seqs ({active}) cannot be greater than --max-num-seqs ({seqs})."
        )
    return scheduler


def _checked_speculative(
    speculative: SpeculativeConfig,
    scheduler: SchedulerConfig,
    model: ModelConfig,
    keywords: bool = False,
) -> SpeculativeConfig:
    """--speculative-config with the --spec-* shorthands folded in. Speculation needs the
    host to know each step's tokens before it plans the next: refused with
    --async-scheduling, before any model is loaded; and custom logits processors see one row
    a sequence (vLLM refuses them together too)."""
    shorthands = {dest: getattr(speculative, dest) for dest, _, _ in SHORTHANDS}
    speculative = SpeculativeConfig(
        with_shorthands(speculative.speculative_config, shorthands, keywords)
    )
    if speculative.speculative_config is not None and model.logits_processors:
        raise ConfigError(
            "--logits-processors: Custom logits processors are not supported when "
            "speculative decoding is enabled (--speculative-config)."
        )
    if speculative.speculative_config is not None and scheduler.async_scheduling:
        raise ConfigError(
            "--async-scheduling cannot be combined with --speculative-config: a step's "
            "drafts are looked up in the tokens the step before it sampled"
        )
    return speculative


def _checked_compilation(
    compilation: CompilationConfig, scheduler: SchedulerConfig
) -> CompilationConfig:
    """The decode sizes are given once: by --cuda-graph-sizes or in --compilation-config
    (or its shorthands --cudagraph-capture-sizes and --max-cudagraph-capture-size). The
    optimization level's defaults fill what they leave open."""
    try:
        settings = with_capture_flags(
            compilation.compilation_config,
            compilation.cudagraph_capture_sizes,
            compilation.max_cudagraph_capture_size,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None
    given = settings.cudagraph_capture_sizes is not None or settings.max_capture_size is not None
    if given and scheduler.cuda_graph_sizes:
        raise ConfigError(
            "--cuda-graph-sizes and --compilation-config's cudagraph_capture_sizes or "
            "max_capture_size both set the decode sizes: give one"
        )
    settings = with_optimization_level(
        settings, compilation.optimization_level, given or bool(scheduler.cuda_graph_sizes)
    )
    return dataclasses.replace(compilation, compilation_config=settings)


def _checked_lora(lora: LoRAConfig) -> LoRAConfig:
    """vLLM's rule between two LoRA arguments: the host cache holds at least a batch's."""
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        raise ConfigError(
            f"--max-cpu-loras ({lora.max_cpu_loras}) must be at least --max-loras "
            f"({lora.max_loras})"
        )
    return lora


def engine_config_from_args(args: argparse.Namespace, *, serving: bool = False) -> EngineConfig:
    """The EngineConfig from a namespace parsed by a parser set up by `add_engine_arguments`;
    `serving` for `serve`, whose defaults on the CPU are vLLM's server's.

    Raises ConfigError when unsupported vLLM arguments were set or values are invalid (the
    Frontend ones included, so that one message names every problem). Attributes that are
    not declared arguments (the subcommand, `--config`, ...) are ignored.
    """
    return _build(
        checked_values((a, getattr(args, a.dest)) for a in ARGUMENTS if hasattr(args, a.dest)),
        serving,
    )


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """The EngineConfig from LLM(**kwargs)-style snake_case keywords.

    Values may be Python values (max_model_len=2048) or the command line's text ("2k");
    None leaves an argument unset. Raises TypeError for names that are not engine arguments
    and ConfigError (a ValueError) for vLLM arguments aioserve does not support yet and for
    invalid values.
    """
    declared = {name: argument(name) for name in kwargs}
    unknown = [name for name, arg in declared.items() if arg is None or not arg.is_keyword]
    if unknown:
        raise TypeError(f"unexpected engine argument(s): {', '.join(unknown)}")
    values = checked_values(((declared[n], v) for n, v in kwargs.items()), keywords=True)
    if values.get("disable_log_stats") is False:  # vLLM's LLM then logs statistics
        raise ConfigError(
            "disable_log_stats=False: the engine on its own logs no statistics "
            "(`aioserve serve` logs them, and exports them at /metrics)"
        )
    return _build(values, keywords=True)
