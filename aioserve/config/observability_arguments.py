"""The arguments that watch the engine rather than change it: vLLM's ObservabilityConfig
(request traces, KV-cache residency, FLOP estimates, CUDA-graph use, per-step logs),
LoggingConfig and the profiler of VllmConfig. Declared here, and spliced into
`arguments.ARGUMENTS` where vLLM's ObservabilityConfig group stands, to keep arguments.py
small.
"""

from __future__ import annotations

from aioserve.config import values
from aioserve.config.declaration import LOGGING, OBSERVABILITY, VLLM, Argument, vllm_only
from aioserve.config.logging_args import LOG_CONFIG_FILE_DEPRECATION, LOG_LEVELS, logging_config
from aioserve.config.profiler import profiler_config

# fmt: off
OBSERVABILITY_ARGUMENTS: tuple[Argument, ...] = (
    # --- ObservabilityConfig ---------------------------------------------------------------
    vllm_only("show-hidden-metrics-for-version", OBSERVABILITY, None,
          "Show metrics hidden since this version."),
    Argument("collect-detailed-traces", OBSERVABILITY, None,
             "With --otlp-traces-endpoint (required), time every model step and add the "
             "times of the steps a request took part in to its span, in seconds: model: "
             "gen_ai.latency.time_in_model_forward (the forward pass: the model's layers and "
             "output head); worker: gen_ai.latency.time_in_model_execute (the whole step on "
             "the model thread: inputs to the device, forward, sampling, results back); all: "
             "both. Several as a list or separated by commas (model,worker). Timed by CUDA/HIP "
             "events on a GPU; nothing is timed without it.",
             "list", convert=values.detailed_trace_modules, metavar="{model,worker,all}"),
    Argument("kv-cache-metrics", OBSERVABILITY, False,
             "KV-cache block residency on /metrics: a sample of the blocks taken from the "
             "free queue (--kv-cache-metrics-sample) is followed until the block is taken "
             "again; vllm:kv_block_lifetime_seconds (taken to evicted), "
             "vllm:kv_block_idle_before_evict_seconds (last prefix-cache hit, or taken, to "
             "evicted) and vllm:kv_block_reuse_gap_seconds (between its last four hits). "
             "Observed with prefix caching only, as in vLLM. Buckets: the "
             "kv_cache_residency family of --custom-histogram-buckets.",
             "bool", convert=values.boolean),
    Argument("kv-cache-metrics-sample", OBSERVABILITY, 0.01,
             "Share of block allocations --kv-cache-metrics follows, in (0, 1].",
             convert=values.fraction),
    Argument("cudagraph-metrics", OBSERVABILITY, False,
             "Log with the stats line, as vLLM does, a table of the interval's model steps: "
             "their tokens, the tokens they ran as (a decode step padded to a decode graph "
             "size), the padding and the CUDA-graph mode (FULL: a captured graph replayed; "
             "NONE: eager, as every step is on the CPU), with how many steps had each, most "
             "frequent first (not with --disable-log-stats).",
             "bool", convert=values.boolean),
    Argument("enable-mfu-metrics", OBSERVABILITY, False,
             "Estimate each step's floating-point operations and memory traffic from the "
             "model's config, its tokens and context lengths, as vLLM does: counted in "
             "vllm:estimated_flops_per_gpu_total, vllm:estimated_read_bytes_per_gpu_total "
             "and vllm:estimated_write_bytes_per_gpu_total, and logged with the stats line "
             "as TF/s and GB/s.",
             "bool", convert=values.boolean),
    Argument("enable-logging-iteration-details", OBSERVABILITY, False,
             "Log one line per engine step with tokens: its context and generation requests "
             "and tokens, its time and the KV-cache usage (not with --disable-log-stats).",
             "bool", convert=values.boolean),
    # --- LoggingConfig ---------------------------------------------------------------------
    Argument("logging-config", LOGGING, {},
             "vLLM's logging settings, as JSON or key by key (--logging-config.log_level "
             "DEBUG): log_level, formatter (text, or json: one JSON object a line), "
             "configure_logging (false leaves Python's logging alone) and "
             "pylogging_config_file (a dictConfig JSON file applied after the default). A key "
             "left out takes its VLLM_* environment variable.",
             "json", convert=logging_config),
    Argument("log-level", LOGGING, None,
             "Shortcut for --logging-config.log_level; overrides that field if both are given.",
             convert=values.string, choices=LOG_LEVELS),
    Argument("log-config-file", LOGGING, None, LOG_CONFIG_FILE_DEPRECATION,
             convert=values.string, metavar="PYLOGGING_CONFIG_FILE"),
    # --- VllmConfig ------------------------------------------------------------------------
    Argument("profiler-config", VLLM, {},
             "The profiler of /start_profile and /stop_profile (and LLM.start_profile), as "
             'JSON: {"profiler": "torch", "torch_profiler_dir": DIR} writes one trace of the '
             "engine's steps a session in DIR; torch_profiler_activities (CPU, CUDA), "
             "torch_profiler_with_stack, _with_flops, _record_shapes, _with_memory, _use_gzip "
             "and _dump_cuda_time_total as in vLLM. Without a profiler here, "
             "VLLM_TORCH_PROFILER_DIR sets the torch one. Other profilers and keys are refused "
             "by name.",
             "json", convert=profiler_config),
)
# fmt: on
