"""vLLM's benchmark rules on fixed inputs: peak concurrency, goodput, oversampling, BurstGPT
rows, range ratios and the custom dataset.

Every expectation is written out, taken from vLLM 0.32's code (the function is named at
each). Where a local vLLM is installed (tests/benchmarks/conftest.py: VLLM_PYTHON), the
same inputs also go through vLLM's own functions (vllm_reference.py), which must agree.
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict

import pytest

from aioserve.benchmarks import datasets, serve_options
from aioserve.benchmarks.statistics import RequestResult, serving_metrics
from aioserve.config.declaration import ConfigError

from .conftest import run_vllm_reference

SEED = 0
DURATION = 3.0
TTFTS = [0.05, 0.30, 0.10, 0.05, 0.20, 0.05]
TOKENS = [4, 4, 1, 4, 4, 4]
LATENCY = 0.45


def _outputs() -> list[RequestResult]:
    """Six requests one after another, 0.45 s each (as with --max-concurrency 1), and a
    failed one."""
    results = []
    for i, (ttft, tokens) in enumerate(zip(TTFTS, TOKENS, strict=True)):
        gaps = [(LATENCY - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
        results.append(
            RequestResult(
                success=True,
                prompt_len=10,
                output_tokens=tokens,
                start_time=LATENCY * i,
                ttft=ttft,
                itl=gaps,
                latency=LATENCY,
            )
        )
    results.append(RequestResult(success=False, start_time=0.1, error="HTTP 500"))
    return results


GOODPUTS = [{}, {"ttft": 100}, {"ttft": 100, "tpot": 100}, {"e2el": 450}]
# serve.py:calculate_metrics: a request is good when objective / 1000 >= its value; TPOT
# is 0 for a one-token request. TTFT 100 keeps 0.05, 0.10 (at the boundary), 0.05, 0.05;
# adding TPOT 100 ms keeps only the one-token request; every E2EL is 0.45 s.
GOOD_COUNTS = [0, 4, 1, 6]
BAD_GOODPUTS = [["ttft=5"], ["speed:5"], ["ttft:-1"], ["ttft:abc"]]
# serve.py:parse_goodput and check_goodput_args.
GOODPUT_MESSAGES = [
    'Specify service level objectives for goodput as "KEY:VALUE" pairs',
    "Invalid metric name found, speed: 5.0.",
    "Invalid value found, ttft: -1.0.",
    'Specify service level objectives for goodput as "KEY:VALUE" pairs',
]
OVERSAMPLE_FROM, OVERSAMPLE_TO = 3, 8
# datasets.py:BenchmarkDataset.maybe_oversample_requests: random.seed(0), then one
# random.choice over the 3 requests per missing one.
OVERSAMPLED = [0, 1, 2, 1, 1, 0, 1, 2]
BURST_ROWS = 5
# datasets.py:BurstGPTDataset._sample_loaded_data: DataFrame.sample(n, random_state=0).
BURST = {"3": [2, 0, 1], "8": [4, 0, 3, 3, 3, 1, 3, 2]}
RANGE_RATIO = '{"input": 0.3, "output": 0.5}'
CUSTOM_ROWS = [
    {"prompt": "What is the capital of India?", "output_tokens": 10},
    {"prompt": "What is the capital of Iran?", "output_tokens": 15},
    {"prompt": "Name three rivers.", "output_tokens": 8},
    {"prompt": "Why is the sky blue?", "output_tokens": 12},
]


@pytest.fixture(scope="module")
def vllm(tiny_model, tmp_path_factory) -> dict | None:
    folder = tmp_path_factory.mktemp("vllm-reference")
    custom = folder / "custom.jsonl"
    custom.write_text("".join(json.dumps(row) + "\n" for row in CUSTOM_ROWS))
    spec = {
        "outputs": [
            {k: v for k, v in asdict(r).items() if k not in ("client_queue_time",)}
            | {"output_tokens": r.output_tokens or 0}
            for r in _outputs()
        ],
        "duration": DURATION,
        "goodputs": GOODPUTS,
        "bad_goodputs": BAD_GOODPUTS,
        "seed": SEED,
        "oversample_from": OVERSAMPLE_FROM,
        "oversample_to": OVERSAMPLE_TO,
        "burst_rows": BURST_ROWS,
        "burst_draws": [3, 8],
        "tokenizer": tiny_model,
        "random_count": 8,
        "random_input_len": 40,
        "random_output_len": 20,
        "range_ratio": RANGE_RATIO,
        "custom_path": str(custom),
        "custom_count": 6,
        "custom_output_len": -1,
    }
    return run_vllm_reference(spec, folder)


def test_peak_concurrency_counts_requests_active_within_each_second(vllm):
    """Slots of one second from the first start: [0, 1) holds requests 0, 1 and 2, [1, 2)
    holds 2, 3 and 4 (serve.py:calculate_metrics). Never more than one at an instant."""
    metrics, _ = serving_metrics(_outputs(), DURATION, [99], len)
    assert metrics.max_concurrent_requests == 3
    if vllm is not None:
        assert vllm["metrics"][0]["max_concurrent_requests"] == 3


@pytest.mark.parametrize("index", range(len(GOODPUTS)))
def test_goodput_counts_requests_within_every_objective(vllm, index):
    metrics, _ = serving_metrics(_outputs(), DURATION, [99], len, GOODPUTS[index])
    assert metrics.request_goodput == pytest.approx(GOOD_COUNTS[index] / DURATION)
    if vllm is not None:
        assert metrics.request_goodput == pytest.approx(vllm["metrics"][index]["request_goodput"])


@pytest.mark.parametrize("index", range(len(BAD_GOODPUTS)))
def test_goodput_refusals_say_what_vllm_says(vllm, index):
    with pytest.raises(ConfigError) as error:
        serve_options.goodput(BAD_GOODPUTS[index])
    assert GOODPUT_MESSAGES[index] in str(error.value)
    assert str(error.value).startswith("--goodput: ")
    if vllm is not None:
        assert vllm["goodput_errors"][index].strip() in str(error.value)


def test_goodput_parses_objectives():
    assert serve_options.goodput(["ttft:200", "e2el:2000.5"]) == {"ttft": 200.0, "e2el": 2000.5}
    assert serve_options.goodput(None) == {}


def test_oversampling_repeats_requests_as_vllm(vllm):
    requests = [datasets.SampleRequest(str(i), i, 1) for i in range(OVERSAMPLE_FROM)]
    datasets.oversample(requests, OVERSAMPLE_TO, SEED)
    assert [r.prompt_len for r in requests] == OVERSAMPLED
    if vllm is not None:
        assert vllm["oversampled"] == OVERSAMPLED
    requests = requests[:OVERSAMPLE_FROM]
    datasets.oversample(requests, OVERSAMPLE_TO, SEED, enabled=False)  # --no-oversample
    assert len(requests) == OVERSAMPLE_FROM


@pytest.mark.parametrize("count", [3, 8])
def test_burstgpt_rows_are_the_ones_vllm_draws(vllm, tokenizer, tmp_path, count):
    path = tmp_path / "burst.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["Timestamp", "Model", "Request tokens", "Response tokens"])
        for row in range(BURST_ROWS):
            writer.writerow([row, "GPT-4", 20 + row, 1 + row])
    requests = datasets.burstgpt_requests(tokenizer, count, str(path), seed=SEED)
    assert [r.expected_output_len - 1 for r in requests] == BURST[str(count)]
    if vllm is not None:
        assert vllm["burst"][str(count)] == BURST[str(count)]


def test_range_ratio_takes_vllms_json_form(vllm, tokenizer):
    input_ratio, output_ratio = datasets.parse_range_ratio(RANGE_RATIO)
    assert (input_ratio, output_ratio) == (0.3, 0.5)
    assert datasets.parse_range_ratio("0.25") == (0.25, 0.25)
    requests = datasets.random_requests(
        tokenizer,
        8,
        40,
        20,
        range_ratio=input_ratio,
        output_range_ratio=output_ratio,
        seed=SEED,
    )
    outputs = [r.expected_output_len for r in requests]
    # datasets/utils.py:get_sampling_params: output lengths from [10, 30], inputs [28, 52]
    assert all(10 <= n <= 30 for n in outputs) and len(set(outputs)) > 1
    special = tokenizer.num_special_tokens_to_add()
    assert all(28 + special <= r.prompt_len <= 52 + special for r in requests)
    if vllm is not None:
        input_lens, output_lens = vllm["random_lens"]
        assert outputs == output_lens
        assert [r.prompt_len - special for r in requests] == input_lens
    for bad in ('{"input": 0.3}', "wide", '{"input": 0.3, "output": 1.5}'):
        with pytest.raises(ConfigError, match="--random-range-ratio"):
            ratios = datasets.parse_range_ratio(bad)
            datasets.random_requests(
                tokenizer, 1, 40, 20, range_ratio=ratios[0], output_range_ratio=ratios[1]
            )


@pytest.mark.parametrize("skip_template", [False, True])
def test_custom_dataset_matches_vllm(vllm, tokenizer, tmp_path, skip_template):
    path = tmp_path / "custom.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CUSTOM_ROWS))
    requests = datasets.custom_requests(
        tokenizer, 6, str(path), output_len=-1, seed=SEED, chat_template=not skip_template
    )
    got = [[r.prompt, r.prompt_len, r.expected_output_len] for r in requests]
    assert len(got) == 6  # 4 rows, 2 repeated
    wanted = {row["prompt"]: row["output_tokens"] for row in CUSTOM_ROWS}
    for prompt, prompt_len, output_len in got:
        text = next(p for p in wanted if p in prompt)
        assert output_len == wanted[text]
        assert prompt_len == len(tokenizer(prompt).input_ids)
        assert (prompt == text) == skip_template
    if vllm is not None:
        assert got == vllm["custom"][int(skip_template)]
    with pytest.raises(ConfigError, match="output_tokens"):
        path.write_text('{"prompt": "hi"}\n')
        datasets.custom_requests(tokenizer, 1, str(path), output_len=None)
    assert (
        datasets.custom_requests(tokenizer, 1, str(path), output_len=7)[0].expected_output_len == 7
    )
    with pytest.raises(ConfigError, match="JSONL"):
        datasets.custom_requests(tokenizer, 1, str(tmp_path / "custom.json"))
