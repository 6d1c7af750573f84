"""--custom-histogram-buckets (vLLM 0.32's): a family's bounds replace the defaults of every
/metrics histogram vLLM puts in that family, the others keep theirs, read back with
prometheus-client's parser and over HTTP from the app `aioserve serve` builds; vLLM's
refusals (unknown family, empty, non-positive, unordered, booleans) name the flag."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from aioserve.cli import build_engine_parser
from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config_from_args
from aioserve.server.metrics import REQUEST_LATENCY_BUCKETS, PrometheusStatLogger
from tests.server.conftest import serve_built
from tests.server.metrics_steps import MODEL, exposition, families

# vLLM 0.32's family of each histogram (v1/metrics/loggers.py).
FAMILY_OF = {
    "vllm:request_prompt_tokens": "request_tokens",
    "vllm:request_generation_tokens": "request_tokens",
    "vllm:request_max_num_generation_tokens": "request_tokens",
    "vllm:request_params_max_tokens": "request_tokens",
    "vllm:request_prefill_kv_computed_tokens": "request_tokens",
    "vllm:iteration_tokens_total": "iteration_tokens",
    "vllm:request_params_n": "request_params_n",
    "vllm:time_to_first_token_seconds": "time_to_first_token",
    "vllm:inter_token_latency_seconds": "inter_token_latency",
    "vllm:request_time_per_output_token_seconds": "inter_token_latency",
    "vllm:e2e_request_latency_seconds": "request_latency",
    "vllm:request_queue_time_seconds": "request_latency",
    "vllm:request_inference_time_seconds": "request_latency",
    "vllm:request_prefill_time_seconds": "request_latency",
    "vllm:request_decode_time_seconds": "request_latency",
    "vllm:request_num_preemptions": "request_num_preemptions",
}


def _bounds(fams: dict, name: str) -> list[float]:
    return [
        float(s.labels["le"])
        for s in fams[name].samples
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
    ]


@pytest.mark.parametrize("family", sorted(set(FAMILY_OF.values())))
def test_a_familys_bounds_replace_the_defaults_of_its_histograms_only(family):
    custom = [0.5, 3.0, 7.0]
    default = exposition(PrometheusStatLogger(MODEL, max_model_len=4096))
    changed = exposition(
        PrometheusStatLogger(MODEL, max_model_len=4096, custom_buckets={family: custom})
    )
    for name, of in FAMILY_OF.items():
        expected = custom if of == family else _bounds(default, name)
        assert _bounds(changed, name) == expected, name
    assert _bounds(default, "vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS


def _frontend(*argv: str):
    return frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ('{"latency": [1]}', "unknown bucket family 'latency'"),
        ('{"request_latency": []}', "must be a non-empty list"),
        ('{"request_latency": [0, 1]}', "must be finite and greater than 0"),
        ('{"request_latency": [2, 1]}', "must be strictly increasing"),
        ('{"request_latency": [1, 1]}', "must be strictly increasing"),
        ('{"request_latency": [true]}', "must be a number"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_vllms_refusals_name_the_flag(given, message):
    with pytest.raises(ConfigError, match="--custom-histogram-buckets") as refused:
        _frontend("--custom-histogram-buckets", given)
    assert message in str(refused.value)


def test_served_metrics_use_the_flags_bounds(engine, server_loop):
    flag = '{"time_to_first_token": [0.25, 2.5], "iteration_tokens": [4, 64, 1024]}'
    with serve_built(server_loop, engine, "--custom-histogram-buckets", flag) as url:

        async def scrape() -> str:
            async with aiohttp.ClientSession() as session:
                async with session.get(url + "/metrics") as response:
                    return await response.text()

        fams = families(asyncio.run(scrape()))
    assert _bounds(fams, "vllm:time_to_first_token_seconds") == [0.25, 2.5]
    assert _bounds(fams, "vllm:iteration_tokens_total") == [4.0, 64.0, 1024.0]
    assert _bounds(fams, "vllm:e2e_request_latency_seconds") == REQUEST_LATENCY_BUCKETS
