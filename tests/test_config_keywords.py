"""aioserve.config through LLM(**kwargs): keywords take the command line's path and checks;
the environment's KV-cache space, the platform defaults and the scheduler's limits."""

from __future__ import annotations

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.build import check_long_prefill_token_threshold
from aioserve.engine.partial_prefills import PartialPrefillLimits, partial_prefill_limits
from tests.test_config import _config

GiB = 2**30


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


# --- LLM(**kwargs) -----------------------------------------------------------------------


def test_kwargs_take_python_values(tmp_path):
    config = engine_config_from_kwargs(
        model=tmp_path,
        dtype="float32",
        max_model_len=2048,
        max_num_seqs=4,
        gpu_memory_utilization=1,
        enforce_eager=True,
        enable_prefix_caching=False,
        served_model_name="solo",
        block_size=None,
        hf_overrides={"a": {"b": 1}},
    )
    assert config.model.model == str(tmp_path)
    assert config.model.dtype == "float32"
    assert config.model.max_model_len == 2048
    assert config.scheduler.max_num_seqs == 4
    assert config.cache.gpu_memory_utilization == 1.0
    assert config.model.enforce_eager is True
    assert config.cache.enable_prefix_caching is False
    assert config.model.served_model_name == ["solo"]
    assert config.cache.block_size is None  # None: not set, the platform's
    assert config.model.hf_overrides == {"a": {"b": 1}}


def test_kwargs_json_values_are_copied():
    overrides = {"a": {"b": 1}}
    config = engine_config_from_kwargs(hf_overrides=overrides)
    overrides["a"]["b"] = 2
    assert config.model.hf_overrides == {"a": {"b": 1}}
    assert engine_config_from_kwargs(hf_overrides='{"x": 1}').model.hf_overrides == {"x": 1}


def test_unknown_kwargs_raise_type_error_naming_them():
    with pytest.raises(TypeError, match="unexpected engine argument.*: max_seqs, colour"):
        engine_config_from_kwargs(max_seqs=3, colour="red", dtype="half")


def test_frontend_names_are_not_engine_kwargs():
    with pytest.raises(TypeError, match="port"):
        engine_config_from_kwargs(port=8000)


@pytest.mark.parametrize(
    "name", ["data_parallel_rank", "swap_space", "enable_lora_bias", "kv_sharing_fast_prefill"]
)
def test_unsupported_kwargs_raise_value_error_naming_them(name):
    with pytest.raises(
        ValueError, match=f"^{name} is a vLLM argument that aioserve does not support yet$"
    ):
        engine_config_from_kwargs(**{name: 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"max_num_seqs": True}, "max_num_seqs must be an integer, got True"),
        ({"max_num_seqs": 2.0}, "max_num_seqs must be an integer, got 2.0"),
        ({"enforce_eager": "yes"}, "enforce_eager must be true or false, got 'yes'"),
        ({"max_model_len": "1.5K"}, "max_model_len takes whole numbers"),
        ({"quantization": "hqq"}, "quantization method 'hqq' is not supported by aioserve yet"),
        ({"gpu_memory_utilization": 2}, "gpu_memory_utilization must be a number greater than 0"),
        ({"served_model_name": []}, "served_model_name must be one or more names"),
        ({"served_model_name": ["a", ""]}, "served_model_name must be non-empty strings"),
        ({"hf_overrides": "nope"}, "hf_overrides must be a JSON object"),
        ({"block_size": 12}, "block_size must be one of 1, 8, 16, 32, 64, 128; got 12"),
        ({"logprobs_mode": "raw"}, "logprobs_mode must be one of raw_logits, raw_logprobs,"),
    ],
)
def test_kwargs_are_validated_like_the_command_line(kwargs, message):
    with pytest.raises(ConfigError) as error:
        engine_config_from_kwargs(**kwargs)
    assert message in str(error.value)


# --- VLLM_CPU_KVCACHE_SPACE --------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"), [("2", 2 * GiB), ("0.5", GiB // 2), ("16", 16 * GiB)]
)
def test_cpu_kvcache_space_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    assert engine_config_from_kwargs().cache.cpu_kvcache_space_bytes == expected


@pytest.mark.parametrize("value", ["0", "-1", "lots", "", "inf", "nan"])
def test_bad_cpu_kvcache_space_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(ConfigError) as error:
        _config()
    assert (
        str(error.value)
        == f"VLLM_CPU_KVCACHE_SPACE must be a positive number of GiB, got {value!r}"
    )


def test_default_model_matches_the_resolver():
    resolve = pytest.importorskip("aioserve.models.resolve")
    assert engine_config_from_kwargs().model.model == resolve.DEFAULT_MODEL


@pytest.mark.parametrize(
    "dest, platform, serving, expected",
    [
        # vLLM-CPU: its server takes 2048 tokens and 128 sequences a step, its LLM class
        # (the offline benchmarks) 4096 and 256; a GPU is not split by use here.
        ("max_num_batched_tokens", "cpu", True, 2048),
        ("max_num_batched_tokens", "cpu", False, 4096),
        ("max_num_batched_tokens", "cuda", True, 8192),
        ("max_num_seqs", "cpu", True, 128),
        ("max_num_seqs", "cpu", False, 256),
        ("max_num_seqs", "rocm", True, 256),
        ("async_scheduling", "cpu", True, False),
        # The torch path's decodes weigh 32-slot key runs (kernels/decode_in_pool.py).
        ("block_size", "cpu", True, 128),
        ("block_size", "cuda", True, 16),
    ],
)
def test_platform_defaults_follow_vllms_usage_contexts(dest, platform, serving, expected):
    from aioserve.engine.resolution import platform_default

    assert platform_default(dest, platform, serving) == expected


def test_the_engine_alone_refuses_to_be_asked_for_statistics_it_does_not_log():
    """LLM(disable_log_stats=False) makes vLLM log statistics; the engine on its own logs
    none, so the value is refused by name rather than dropped. True (vLLM's default for
    LLM) is what happens anyway."""
    with pytest.raises(ConfigError, match="disable_log_stats=False"):
        engine_config_from_kwargs(disable_log_stats=False)
    assert engine_config_from_kwargs(disable_log_stats=True).model.model


def test_a_long_prefill_token_threshold_past_the_context_is_refused_naming_the_flag():
    check_long_prefill_token_threshold(2048, 2048)
    with pytest.raises(ValueError, match=r"--long-prefill-token-threshold \(2049\) cannot be"):
        check_long_prefill_token_threshold(2049, 2048)


def test_partial_prefill_keywords_are_checked_as_the_flags_are():
    scheduler = engine_config_from_kwargs(
        max_num_partial_prefills=3, max_long_partial_prefills=2
    ).scheduler
    assert (scheduler.max_num_partial_prefills, scheduler.max_long_partial_prefills) == (3, 2)
    with pytest.raises(ConfigError, match="Chunked prefill must be enabled"):
        engine_config_from_kwargs(max_num_partial_prefills=2, enable_chunked_prefill=False)
    # One partial prefill at a time needs no chunked prefill (vLLM's default).
    scheduler = engine_config_from_kwargs(enable_chunked_prefill=False).scheduler
    assert scheduler.max_num_partial_prefills == 1


def test_partial_prefills_take_4_percent_of_the_context_as_long_without_a_threshold():
    """vLLM: with --max-num-partial-prefills > 1 and no --long-prefill-token-threshold, a
    prompt is long past int(max_model_len * 0.04) tokens; a given threshold stays."""
    assert partial_prefill_limits(2, 1, 0, 2048) == PartialPrefillLimits(2, 1, 81)
    assert partial_prefill_limits(4, 2, 300, 2048) == PartialPrefillLimits(4, 2, 300)
    assert partial_prefill_limits(1, 1, 0, 2048) is None  # the default: scheduling as without


def test_kv_events_config_keyword_takes_a_dict_and_names_the_keyword():
    config = engine_config_from_kwargs(model="m", kv_events_config={"enable_kv_cache_events": True})
    assert config.cache.kv_events_config.publishes
    with pytest.raises(ConfigError) as error:
        engine_config_from_kwargs(
            model="m",
            kv_events_config={"enable_kv_cache_events": True},
            enable_prefix_caching=False,
        )
    assert str(error.value) == (
        "kv_events_config: enable_kv_cache_events needs prefix caching, which "
        "enable_prefix_caching=False turns off"
    )
