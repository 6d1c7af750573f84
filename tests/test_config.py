"""aioserve.config: each supported argument parses, converts and validates; every other vLLM
argument is recognised and refused by name (LLM(**kwargs): tests/test_config_keywords.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from aioserve.config.arguments import ARGUMENTS
from aioserve.config.compilation import CompilationSettings
from aioserve.config.declaration import FRONTEND, ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.config.kv_events import KVEventsSettings
from aioserve.config.parser import UNSUPPORTED_GROUP_TITLE, add_engine_arguments
from aioserve.config.profiler import ProfilerSettings
from aioserve.config.speculative import NgramSpeculation

GiB = 2**30


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _parser(**options) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test", allow_abbrev=False)
    add_engine_arguments(parser, **options)
    return parser


def _config(*argv: str):
    return engine_config_from_args(_parser().parse_args(list(argv)))


def _field(config, path: str):
    section, name = path.split(".")
    return getattr(getattr(config, section), name)


def test_defaults():
    config = engine_config_from_kwargs()
    assert config.model.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert config.model.tokenizer == config.model.model
    assert (config.model.tokenizer_mode, config.model.dtype) == ("auto", "auto")
    assert (config.model.seed, config.model.max_logprobs) == (0, 20)
    assert config.model.logprobs_mode == "raw_logprobs"
    assert config.model.trust_remote_code is False
    assert config.model.enforce_eager is False
    assert config.model.skip_tokenizer_init is False
    assert config.model.max_model_len is None
    assert config.model.quantization is None
    assert config.model.generation_config == "auto"
    assert config.model.override_generation_config == {}
    assert config.model.hf_overrides == {}
    assert config.model.served_model_name is None
    assert config.load.load_format == "auto"
    assert config.load.download_dir is None
    assert config.cache.block_size is None  # the platform's: 128 on the CPU, 16 on a GPU
    assert config.cache.gpu_memory_utilization == 0.9
    assert config.cache.num_gpu_blocks_override is None
    assert config.cache.enable_prefix_caching is True
    assert config.cache.kv_cache_dtype == "auto"
    assert config.cache.calculate_kv_scales is False
    assert config.cache.cpu_kvcache_space_bytes == 4 * GiB
    assert config.scheduler.max_num_seqs is None  # the platform's (engine/build.py)
    assert config.scheduler.max_num_batched_tokens is None  # the platform's (engine/build.py)
    assert config.scheduler.enable_chunked_prefill is True
    assert config.scheduler.async_scheduling is None  # the platform's (engine/build.py)
    assert config.scheduler.scheduling_policy == "fcfs"
    assert config.scheduler.max_num_queued_reqs is None
    assert config.scheduler.max_num_queued_tokens is None
    assert config.scheduler.cuda_graph_sizes == []  # the platform's (engine/build.py)
    assert config.model.max_seq_len_to_capture == 8192
    assert _config() == config


SUPPORTED_FLAGS = [
    (["--model", "org/m"], "model.model", "org/m"),
    (["--tokenizer", "org/tok"], "model.tokenizer", "org/tok"),
    (["--tokenizer-mode", "slow"], "model.tokenizer_mode", "slow"),
    (["--trust-remote-code"], "model.trust_remote_code", True),
    (["--no-trust-remote-code"], "model.trust_remote_code", False),
    (["--dtype", "bfloat16"], "model.dtype", "bfloat16"),
    (["--dtype", "half"], "model.dtype", "half"),
    (["--seed", "1234"], "model.seed", 1234),
    (["--max-model-len", "2048"], "model.max_model_len", 2048),
    (["--quantization", "gguf"], "model.quantization", "gguf"),
    (["-q", "gguf"], "model.quantization", "gguf"),
    (["--quantization", "awq"], "model.quantization", "awq"),
    (["-q", "gptq_marlin"], "model.quantization", "gptq_marlin"),
    (["--enforce-eager"], "model.enforce_eager", True),
    (["--max-seq-len-to-capture", "4096"], "model.max_seq_len_to_capture", 4096),
    (["--max-logprobs", "5"], "model.max_logprobs", 5),
    (["--max-logprobs", "-1"], "model.max_logprobs", -1),
    (["--logprobs-mode", "raw_logits"], "model.logprobs_mode", "raw_logits"),
    (["--logprobs-mode", "processed_logprobs"], "model.logprobs_mode", "processed_logprobs"),
    (["--generation-config", "vllm"], "model.generation_config", "vllm"),
    (["--override-generation-config", '{"temperature": 0.5}'], "model.override_generation_config",
     {"temperature": 0.5}),
    (["--hf-overrides", '{"rope_theta": 1e6, "a": {"b": [1]}}'], "model.hf_overrides",
     {"rope_theta": 1e6, "a": {"b": [1]}}),
    (["--rope-scaling", '{"rope_type": "yarn", "factor": 4}'], "model.rope_scaling",
     {"rope_type": "yarn", "factor": 4}),
    (["--rope-theta", "1e6"], "model.rope_theta", 1e6),
    (["--hf-config-path", "/models/config-only"], "model.hf_config_path", "/models/config-only"),
    (["--revision", "v1.1"], "model.revision", "v1.1"),
    (["--tokenizer-revision", "0123abc"], "model.tokenizer_revision", "0123abc"),
    (["--hf-token", "hf_abc"], "model.hf_token", "hf_abc"),
    (["--hf-token"], "model.hf_token", True),  # the token `hf auth login` stored
    (["--disable-sliding-window"], "model.disable_sliding_window", True),
    (["--served-model-name", "one"], "model.served_model_name", ["one"]),
    (["--enable-lora"], "lora.enable_lora", True),
    (["--no-enable-lora"], "lora.enable_lora", False),
    (["--max-loras", "4"], "lora.max_loras", 4),
    (["--max-lora-rank", "64"], "lora.max_lora_rank", 64),
    (["--lora-dtype", "bfloat16"], "lora.lora_dtype", "bfloat16"),
    (["--max-cpu-loras", "8"], "lora.max_cpu_loras", 8),
    (["--served-model-name", "one", "two"], "model.served_model_name", ["one", "two"]),
    (["--skip-tokenizer-init"], "model.skip_tokenizer_init", True),
    (["--enable-prompt-embeds"], "model.enable_prompt_embeds", True),
    (["--enable-sleep-mode"], "model.enable_sleep_mode", True),
    (["--logits-processors", "a.b:C", "d:E"], "model.logits_processors", ("a.b:C", "d:E")),
    (["--stream-interval", "4"], "scheduler.stream_interval", 4),
    (["--kv-cache-memory-bytes", "2G"], "cache.kv_cache_memory_bytes", 2**31),
    (["--cudagraph-capture-sizes", "1", "4"], "compilation.cudagraph_capture_sizes", [1, 4]),
    (["--max-cudagraph-capture-size", "64"], "compilation.max_cudagraph_capture_size", 64),
    (["--runner", "pooling"], "model.runner", "pooling"),
    (["--convert", "none"], "model.convert", "none"),
    (["--task", "embed"], "model.task", "embed"),
    (["--override-pooler-config", '{"pooling_type": "CLS"}'], "model.override_pooler_config",
     {"pooling_type": "CLS"}),
    (["--load-format", "dummy"], "load.load_format", "dummy"),
    (["--load-format", "gguf"], "load.load_format", "gguf"),
    (["--use-tqdm-on-load"], "load.use_tqdm_on_load", True),
    (["--no-use-tqdm-on-load"], "load.use_tqdm_on_load", False),
    (["--download-dir", "/data/weights"], "load.download_dir", "/data/weights"),
    (["--ignore-patterns", "*.bin", "original/"], "load.ignore_patterns", ["*.bin", "original/"]),
    (["--pt-load-map-location", "cuda:1"], "load.pt_load_map_location", "cuda:1"),
    (["--pt-load-map-location", '{"cuda:1": "cpu"}'], "load.pt_load_map_location", {"cuda:1": "cpu"}),
    (["--block-size", "32"], "cache.block_size", 32),
    (["--gpu-memory-utilization", "0.5"], "cache.gpu_memory_utilization", 0.5),
    (["--gpu-memory-utilization", "1"], "cache.gpu_memory_utilization", 1.0),
    (["--num-gpu-blocks-override", "64"], "cache.num_gpu_blocks_override", 64),
    (["--enable-prefix-caching"], "cache.enable_prefix_caching", True),
    (["--prefix-caching-hash-algo", "sha256_cbor"], "cache.prefix_caching_hash_algo", "sha256_cbor"),
    (["--no-enable-prefix-caching"], "cache.enable_prefix_caching", False),
    (["--kv-cache-dtype", "fp8"], "cache.kv_cache_dtype", "fp8"),
    (["--kv-cache-dtype", "fp8_e5m2"], "cache.kv_cache_dtype", "fp8_e5m2"),
    (["--calculate-kv-scales"], "cache.calculate_kv_scales", True),
    (["--no-calculate-kv-scales"], "cache.calculate_kv_scales", False),
    (["--max-num-seqs", "3"], "scheduler.max_num_seqs", 3),
    (["--max-num-batched-tokens", "512"], "scheduler.max_num_batched_tokens", 512),
    (["--enable-chunked-prefill"], "scheduler.enable_chunked_prefill", True),
    (["--no-enable-chunked-prefill"], "scheduler.enable_chunked_prefill", False),
    (["--async-scheduling"], "scheduler.async_scheduling", True),
    (["--no-async-scheduling"], "scheduler.async_scheduling", False),
    (["--scheduling-policy", "priority"], "scheduler.scheduling_policy", "priority"),
    (["--max-num-queued-reqs", "8"], "scheduler.max_num_queued_reqs", 8),
    (["--cuda-graph-sizes", "64"], "scheduler.cuda_graph_sizes", [64]),
    (["--cuda-graph-sizes", "1", "2", "128"], "scheduler.cuda_graph_sizes", [1, 2, 128]),
    (["--max-num-queued-tokens", "32k"], "scheduler.max_num_queued_tokens", 32000),
    (["--long-prefill-token-threshold", "256"], "scheduler.long_prefill_token_threshold", 256),
    (["--max-num-partial-prefills", "4"], "scheduler.max_num_partial_prefills", 4),
    (["--max-long-partial-prefills", "2", "--max-num-partial-prefills", "4"], "scheduler.max_long_partial_prefills", 2),
    (["--max-num-queued-tokens", "2048"], "scheduler.max_num_queued_tokens", 2048),
    (["--scheduler-delay-factor", "0.5"], "scheduler.scheduler_delay_factor", 0.5),
    (["--max-num-scheduled-tokens", "2k"], "scheduler.max_num_scheduled_tokens", 2000),
    (["--max-num-active-seqs", "4"], "scheduler.max_num_active_seqs", 4),
    (["--long-prefill-token-threshold-adaptive"], "scheduler.long_prefill_token_threshold_adaptive", True),
    (["--no-long-prefill-token-threshold-adaptive"], "scheduler.long_prefill_token_threshold_adaptive", False),
    (["--scheduler-reserve-full-isl"], "scheduler.scheduler_reserve_full_isl", True),
    (["--no-scheduler-reserve-full-isl"], "scheduler.scheduler_reserve_full_isl", False),
    (["--watermark", "0.1"], "scheduler.watermark", 0.1),
    (["--watermark", "0"], "scheduler.watermark", 0.0),
    (["--reasoning-parser", "qwen3"], "decoding.reasoning_parser", "qwen3"),
    (
        ["--reasoning-config", '{"reasoning_start_str": "<t>", "reasoning_end_str": "</t>"}'],
        "decoding.reasoning_config",
        {"reasoning_start_str": "<t>", "reasoning_end_str": "</t>"},
    ),
    (["--guided-decoding-backend", "guidance"], "decoding.guided_decoding_backend", "guidance"),
    (["--guided-decoding-disable-fallback"], "decoding.guided_decoding_disable_fallback", True),
    (["--guided-decoding-disable-any-whitespace"], "decoding.guided_decoding_disable_any_whitespace", True),
    (["--guided-decoding-disable-additional-properties"], "decoding.guided_decoding_disable_additional_properties", True),
    (["--structured-outputs-config", '{"backend": "outlines"}'], "decoding.structured_outputs_config", {"backend": "outlines"}),
    (["--kv-events-config", '{"enable_kv_cache_events": true}'], "cache.kv_events_config", KVEventsSettings(True, "zmq")),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "null", "topic": "t"}'], "cache.kv_events_config", KVEventsSettings(True, "null", topic="t")),
    (["--kv-events-config", '{"endpoint": "tcp://127.0.0.1:5600", "replay_endpoint": "ipc:///tmp/r", "buffer_steps": 5, "hwm": 0, "max_queue_size": 9}'], "cache.kv_events_config", KVEventsSettings(False, "null", "tcp://127.0.0.1:5600", "ipc:///tmp/r", 5, 0, 9)),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], "speculative.speculative_config", NgramSpeculation(3, 5, 5)),
    (["--spec-method", "ngram", "--spec-tokens", "3"], "speculative.speculative_config", NgramSpeculation(3, 5, 5)),
    (["--spec-model", "[ngram]", "--spec-tokens", "2"], "speculative.speculative_config", NgramSpeculation(2, 5, 5)),
    (["--spec-tokens", "4", "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}'], "speculative.speculative_config", NgramSpeculation(4, 3, 3)),
    (["--compilation-config", "0"], "compilation.compilation_config", CompilationSettings(level=0)),
    (["--optimization-level", "0"], "compilation.optimization_level", 0),
    (["--performance-mode", "throughput"], "compilation.performance_mode", "throughput"),
    (["--device", "cpu"], "device.device", "cpu"),
    (["--tensor-parallel-size", "1"], "parallel.tensor_parallel_size", 1),
    (["--pipeline-parallel-size", "1"], "parallel.pipeline_parallel_size", 1),
    (["--data-parallel-size", "1"], "parallel.data_parallel_size", 1),
    (["--distributed-executor-backend", "uni"], "parallel.distributed_executor_backend", "uni"),
    (["--preemption-mode", "recompute"], "scheduler.preemption_mode", "recompute"),
    (["--disable-cascade-attn"], "model.disable_cascade_attn", True),
    (["--model-impl", "transformers"], "model.model_impl", "transformers"),
    (["--limit-mm-per-prompt", '{"image": 2, "video": {"count": 0}}'], "model.limit_mm_per_prompt", {"image": 2, "video": 0}),
    (["--allowed-local-media-path", "/"], "model.allowed_local_media_path", "/"),
    (["--collect-detailed-traces", "model,worker", "--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"], "observability.collect_detailed_traces", ["model", "worker"]),
    (["--logging-config", '{"log_level": "DEBUG", "formatter": "json"}'], "logging.logging_config", {"log_level": "DEBUG", "formatter": "json"}),
    (["--logging-config", '{"configure_logging": false}'], "logging.logging_config", {"configure_logging": False}),
    (["--log-level", "WARNING"], "logging.log_level", "WARNING"),
    (["--log-config-file", "/etc/log.json"], "logging.log_config_file", "/etc/log.json"),
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/t", "torch_profiler_record_shapes": true}'], "profiler.profiler_config", ProfilerSettings("/tmp/t", torch_profiler_record_shapes=True)),
    (["--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/tmp/t", "torch_profiler_activities": ["CPU"]}'], "profiler.profiler_config", ProfilerSettings("/tmp/t", ("CPU",))),
    (["--kv-cache-metrics"], "observability.kv_cache_metrics", True),
    (["--no-kv-cache-metrics"], "observability.kv_cache_metrics", False),
    (["--kv-cache-metrics-sample", "0.5"], "observability.kv_cache_metrics_sample", 0.5),
    (["--kv-cache-metrics-sample", "1"], "observability.kv_cache_metrics_sample", 1.0),
    (["--enable-mfu-metrics"], "observability.enable_mfu_metrics", True),
    (["--enable-logging-iteration-details"], "observability.enable_logging_iteration_details", True),
    (["--cudagraph-metrics"], "observability.cudagraph_metrics", True),
    (["--no-cudagraph-metrics"], "observability.cudagraph_metrics", False),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "path", "expected"), SUPPORTED_FLAGS)
def test_supported_flag_sets_its_field(argv, path, expected):
    value = _field(_config(*argv), path)
    assert value == expected
    assert type(value) is type(expected)


def test_every_supported_engine_argument_is_tested_and_fills_a_field():
    # The Frontend arguments are the HTTP server's (tests/server/test_serve_command.py).
    engine_arguments = [a for a in ARGUMENTS if a.supported and a.group != FRONTEND]
    tested = {argv[0] for argv, _, _ in SUPPORTED_FLAGS}
    for argument in engine_arguments:
        assert argument.flag in tested
    config = engine_config_from_kwargs()
    sections = (
        config.model,
        config.load,
        config.cache,
        config.scheduler,
        config.decoding,
        config.lora,
        config.speculative,
        config.compilation,
        config.device,
        config.parallel,
        config.observability,
        config.logging,
        config.profiler,
    )
    fields = {field.name for section in sections for field in dataclasses.fields(section)}
    assert fields == {a.dest for a in engine_arguments} | {"cpu_kvcache_space_bytes"}


def test_tokenizer_follows_model_unless_given():
    assert _config("--model", "org/m").model.tokenizer == "org/m"
    assert _config("--model", "org/m", "--tokenizer", "org/t").model.tokenizer == "org/t"


def test_hub_arguments_are_unset_by_default_and_the_token_never_shown():
    model = _config("--revision", "v2", "--hf-token", "hf_secret").model
    assert (model.revision, model.tokenizer_revision) == ("v2", None)  # None: --revision's
    assert "hf_secret" not in repr(model) and "hf_secret" not in repr(_config("--hf-token", "x"))
    assert engine_config_from_kwargs(hf_token=False).model.hf_token is False  # no token at all


def test_code_revision_is_refused_with_its_reason():
    with pytest.raises(ConfigError) as error:
        _config("--code-revision", "v1", "--trust-remote-code")
    assert str(error.value) == (
        "--code-revision is a vLLM argument that aioserve does not support: it picks the "
        "revision of the code a model's repository ships (its auto_map classes, run with "
        "--trust-remote-code), and aioserve never runs code shipped with a model"
    )
    with pytest.raises(ConfigError, match="^code_revision is a vLLM argument .*auto_map"):
        engine_config_from_kwargs(code_revision="v1")


@pytest.mark.parametrize(("value", "got"), [("", "an empty string"), (42, "a value of type int")])
def test_a_bad_hf_token_is_refused_without_repeating_it(value, got):
    with pytest.raises(ConfigError) as error:
        engine_config_from_kwargs(hf_token=value)
    assert str(error.value) == (
        "hf_token must be a token (a non-empty string), or true for the token stored by "
        f"`hf auth login`; got {got}"
    )
    assert "42" not in str(error.value)


def test_generation_config_folder(tmp_path):
    assert _config("--generation-config", str(tmp_path)).model.generation_config == str(tmp_path)
    missing = str(tmp_path / "missing")
    with pytest.raises(
        ConfigError, match="--generation-config must be 'auto', 'vllm' or an existing folder"
    ):
        _config("--generation-config", missing)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("2m", 2_000_000),
        ("2M", 2 * 2**20),
        ("1g", 10**9),
        ("1G", 2**30),
        ("32K", 32768),
        ("4096", 4096),
        ("0.5k", 500),
    ],
)
def test_max_model_len_suffixes(text, tokens):
    assert _config("--max-model-len", text).model.max_model_len == tokens
    assert engine_config_from_kwargs(max_model_len=text).model.max_model_len == tokens


@pytest.mark.parametrize("text", ["1.5K", "abc", "1x", "k", "1kk", "0", "-5", "1.0001k", "", "1e3"])
def test_max_model_len_bad_forms_name_flag_and_value(text):
    with pytest.raises(ConfigError) as error:
        _config("--max-model-len", text)
    message = str(error.value)
    assert message.startswith("--max-model-len ")
    assert repr(text) in message or text.lstrip("-") in message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
        (["--max-num-batched-tokens", "-3"], "--max-num-batched-tokens must be at least 1, got -3"),
        (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override must be at least 1, got 0"),
        (["--max-logprobs", "-2"], "--max-logprobs must be at least -1, got -2"),
        (["--max-num-seqs", "two"], "--max-num-seqs must be an integer, got 'two'"),
        (["--max-num-queued-reqs", "0"], "--max-num-queued-reqs must be at least 1, got 0"),
        (["--max-num-queued-reqs", "lots"], "--max-num-queued-reqs must be an integer, got 'lots'"),
        (["--max-num-queued-tokens", "0"], "--max-num-queued-tokens must be at least 1, got 0"),
        (
            ["--long-prefill-token-threshold", "-1"],
            "--long-prefill-token-threshold must be at least 0, got -1",
        ),
        (
            ["--reasoning-parser", "openai_gptoss"],
            "reasoning parser 'openai_gptoss' is not supported by aioserve yet "
            '(--reasoning-parser accepts "" (none), deepseek_r1, deepseek_v3, ernie45, glm45, '
            "glm47, granite, holo2, hunyuan_a13b, kimi_k2, ling3, mimo, minimax_m2, "
            "minimax_m2_append_think, mistral, nemotron_v3, olmo3, qwen3, seed_oss, step3, "
            "step3p5)",
        ),
        (["--max-num-queued-tokens", "1.5K"], "--max-num-queued-tokens takes whole numbers"),
        (
            ["--guided-decoding-backend", "lm-format-enforcer"],
            "structured-output backend 'lm-format-enforcer' is not supported by aioserve yet "
            "(--guided-decoding-backend accepts auto, outlines, guidance, xgrammar)",
        ),
        (
            ["--structured-outputs-config", '{"backend": "lm-format-enforcer"}'],
            "--structured-outputs-config key 'backend' must be one of auto, outlines, guidance, "
            "xgrammar",
        ),
        (
            ["--structured-outputs-config", '{"reasoning_parser": "qwen3"}'],
            "--structured-outputs-config key 'reasoning_parser' is not supported by aioserve yet",
        ),
        (["--structured-outputs-config", '{"foo": 1}'], "--structured-outputs-config has no key 'foo'"),
        (["--kv-events-config", '{"enable_kv_cache_events": true, "foo": 1}'], "--kv-events-config has no key 'foo' (it takes enable_kv_cache_events, publisher, endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic)"),
        (["--kv-events-config", '{"publisher": "kafka"}'], "--kv-events-config key 'publisher' must be one of null, zmq, got 'kafka'"),
        (["--kv-events-config", '{"publisher": "zmq"}'], '--kv-events-config publisher "zmq" publishes nothing without "enable_kv_cache_events": true'),
        (["--kv-events-config", '{"endpoint": "localhost:5557"}'], "--kv-events-config key 'endpoint' must be a ZMQ endpoint"),
        (["--kv-events-config", '{"buffer_steps": 0}'], "--kv-events-config key 'buffer_steps' must be at least 1, got 0"),
        (["--kv-events-config", "[]"], "--kv-events-config must be a JSON object, got []"),
        (["--kv-events-config", '{"enable_kv_cache_events": true}', "--no-enable-prefix-caching"], "--kv-events-config: enable_kv_cache_events needs prefix caching, which --no-enable-prefix-caching turns off"),
        (["--seed", "1.5"], "--seed must be an integer, got '1.5'"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a number greater than 0"),
        (["--gpu-memory-utilization", "1.01"], "--gpu-memory-utilization must be a number greater than 0"),
        (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be a number greater than 0"),
        (["--gpu-memory-utilization", "most"], "--gpu-memory-utilization must be a number greater than 0"),
        (["--dtype", "int8"], "--dtype must be one of auto, half, float16, bfloat16, float, float32; got 'int8'"),
        (["--block-size", "7"], "--block-size must be one of 1, 8, 16, 32, 64, 128; got 7"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy must be one of fcfs, priority; got 'lifo'"),
        (["--logprobs-mode", "logits"], "--logprobs-mode must be one of raw_logits, raw_logprobs, processed_logits, processed_logprobs; got 'logits'"),
        (["--quantization", "bitsandbytes"], "quantization method 'bitsandbytes' is not supported by aioserve yet"),
        (["-q", "gptq_marlin_24"], "quantization method 'gptq_marlin_24' is not supported by aioserve yet"),
        (["--quantization", "nonsense"], "--quantization must be one of gguf, awq, awq_marlin, gptq, gptq_marlin, fp8, compressed-tensors; got 'nonsense'"),
        (["--load-format", "tensorizer"], "load format 'tensorizer' is not supported by aioserve yet"),
        (["--load-format", "zip"], "--load-format must be one of auto, safetensors, pt, gguf, dummy; got 'zip'"),
        (["--pt-load-map-location", "gpu"], "--pt-load-map-location must be a device (cpu, cuda or cuda:N)"),
        (["--pt-load-map-location", '{"cuda:1": 0}'], "--pt-load-map-location must be a device"),
        (["--pt-load-map-location", '{"cuda:1": }'], "--pt-load-map-location is not valid JSON"),
        (["--tokenizer-mode", "mistral"], "tokenizer mode 'mistral' is not supported by aioserve yet"),
        (["--runner", "draft"], "runner 'draft' is not supported by aioserve yet (--runner accepts auto, generate, pooling)"),
        (["--convert", "reward"], "conversion 'reward' is not supported by aioserve yet (--convert accepts auto, none, embed)"),
        (["--task", "score"], "task 'score' is not supported by aioserve yet"),
        (["--task", "chat"], "--task must be one of auto, generate, embed, embedding; got 'chat'"),
        (["--override-pooler-config", "[]"], "--override-pooler-config must be a JSON object, got []"),
        (["--hf-overrides", "[1, 2]"], "--hf-overrides must be a JSON object, got [1, 2]"),
        (["--rope-scaling", '"yarn"'], "--rope-scaling must be a JSON object, got 'yarn'"),
        (["--rope-theta", "0"], "--rope-theta must be a number greater than 0, got '0'"),
        (["--rope-theta", "inf"], "--rope-theta must be a number greater than 0, got 'inf'"),
        (["--override-generation-config", '"hot"'], "--override-generation-config must be a JSON object"),
        (["--model", ""], "--model must be a non-empty string"),
        (["--cuda-graph-sizes", "0"], "--cuda-graph-sizes must be at least 1, got 0"),
        (["--cuda-graph-sizes", "8", "x"], "--cuda-graph-sizes must be an integer, got 'x'"),
        (["--max-seq-len-to-capture", "0"], "--max-seq-len-to-capture must be at least 1, got 0"),
        (["--max-loras", "0"], "--max-loras must be at least 1, got 0"),
        (["--max-lora-rank", "17"], "--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512; got 17"),
        (["--lora-dtype", "float32"], "--lora-dtype must be one of auto, float16, bfloat16; got 'float32'"),
        (["--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras (1) must be at least --max-loras (2)"),
        (["--max-num-partial-prefills", "two"], "--max-num-partial-prefills must be an integer, got 'two'"),
        (["--max-num-partial-prefills", "0"], "--max-num-partial-prefills (0) must be greater than or equal to 1."),
        (["--max-num-partial-prefills", "2", "--no-enable-chunked-prefill"], "Chunked prefill must be enabled to set --max-num-partial-prefills > 1."),
        (["--max-long-partial-prefills", "0"], "--max-long-partial-prefills (0) must be greater than or equal to 1 and less than or equal to --max-num-partial-prefills (1)."),
        (["--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"], "--max-long-partial-prefills (3) must be greater than or equal to 1 and less than or equal to --max-num-partial-prefills (2)."),
    ],
)  # fmt: skip
def test_invalid_values_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as error:
        _config(*argv)
    assert message in str(error.value)
    assert isinstance(error.value, ValueError)


def test_refused_choice_says_what_is_accepted():
    with pytest.raises(ConfigError, match=r"\(--quantization accepts gguf, awq, awq_marlin, gptq,"):
        _config("--quantization", "bitsandbytes")


def test_bad_json_text_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--hf-overrides", "{not json"])
    assert exit_info.value.code == 2
    assert "argument --hf-overrides: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "spelling"),
    [
        (["-dpn", "2"], "--data-parallel-rank (-dpn)"),
        (["--data-parallel-rank", "0"], "--data-parallel-rank (-dpn)"),  # vLLM's default too
        (["--kv-sharing-fast-prefill"], "--kv-sharing-fast-prefill"),
        (["--enable-lora-bias"], "--enable-lora-bias"),
        (["--fully-sharded-loras"], "--fully-sharded-loras"),
        (["--num-speculative-tokens", "4"], "--num-speculative-tokens"),
        (["--use-v2-block-manager"], "--use-v2-block-manager"),
        (["--lora-extra-vocab-size", "256"], "--lora-extra-vocab-size"),
        (["--prompt-adapters", "a=/x"], "--prompt-adapters"),
    ],
)
def test_unsupported_vllm_arguments_are_refused_by_name(argv, spelling):
    with pytest.raises(ConfigError) as error:
        _config("--max-num-seqs", "4", *argv)
    assert str(error.value) == f"{spelling} is a vLLM argument that aioserve does not support yet"


def test_kv_cache_dtype_takes_fp8_and_refuses_fp8_inc_by_name():
    for value in ("fp8", "fp8_e4m3", "fp8_e5m2", "auto"):
        assert _config("--kv-cache-dtype", value).cache.kv_cache_dtype == value
    with pytest.raises(ConfigError) as error:
        _config("--kv-cache-dtype", "fp8_inc")
    assert str(error.value) == (
        "KV-cache dtype 'fp8_inc' is not supported by aioserve yet "
        "(--kv-cache-dtype accepts auto, fp8, fp8_e4m3, fp8_e5m2)"
    )


def test_several_unsupported_arguments_are_all_named():
    with pytest.raises(ConfigError) as error:
        _config("-dpn", "2", "--swap-space", "8")
    message = str(error.value)
    assert "--data-parallel-rank (-dpn)" in message and "--swap-space" in message
    assert message.endswith("are vLLM arguments that aioserve does not support yet")


def test_every_problem_of_a_command_line_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        _config("--swap-space", "8", "--quantization", "hqq", "--max-num-seqs", "0", "--port", "x")
    assert str(error.value) == (
        "--swap-space is a vLLM argument that aioserve does not support yet; "
        "--port must be an integer, got 'x'; quantization method 'hqq' is not supported by "
        "aioserve yet (--quantization accepts gguf, awq, awq_marlin, gptq, gptq_marlin, fp8, "
        "compressed-tensors); "
        "--max-num-seqs must be at least 1, got 0"
    )


def _minimal_argv(argument) -> list[str]:
    if argument.kind in ("flag", "bool", "optional"):
        return [argument.flag]
    value = {"json": "{}"}.get(argument.kind, str(argument.choices[0]) if argument.choices else "1")
    return [argument.flag, value]


@pytest.mark.parametrize(
    "argument", [a for a in ARGUMENTS if not a.supported], ids=lambda a: a.name
)
def test_every_unsupported_argument_parses_and_is_refused(argument):
    namespace = _parser().parse_args(_minimal_argv(argument))
    with pytest.raises(ConfigError, match="^" + re.escape(argument.spelling) + " is a vLLM"):
        engine_config_from_args(namespace)


def test_unknown_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(["--max-num-sequences", "4"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-num-sequences" in capsys.readouterr().err


def test_parser_holds_only_what_was_given():
    namespace = _parser().parse_args(["--dtype", "half"])
    assert vars(namespace) == {"dtype": "half"}


def test_help_lists_supported_groups_then_the_unsupported_ones():
    text = _parser().format_help()
    positions = [
        text.index(f"\n{title}:")
        for title in (
            "ModelConfig",
            "LoadConfig",
            "CacheConfig",
            "SchedulerConfig",
            UNSUPPORTED_GROUP_TITLE,
        )
    ]
    assert positions == sorted(positions)
    unsupported_part = text[positions[-1] :]
    for flag in (
        "--data-parallel-rank",
        "--headless",
        "--kv-sharing-fast-prefill",
        "--speculative-model",
    ):
        assert flag in unsupported_part
    assert "--max-num-seqs" not in unsupported_part
    assert "(default: 0.9)" in " ".join(text.split())


def test_frontend_arguments_can_be_left_out():
    parser = _parser(frontend=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "8000"])
    assert (
        engine_config_from_args(parser.parse_args(["--max-num-seqs", "2"])).scheduler.max_num_seqs
        == 2
    )
    with pytest.raises(ConfigError, match="--swap-space"):
        engine_config_from_args(parser.parse_args(["--swap-space", "2"]))


def test_config_objects_are_frozen():
    config = engine_config_from_kwargs()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 8  # type: ignore[misc]
