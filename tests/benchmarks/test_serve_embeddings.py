"""`aioserve bench serve --backend openai-embeddings`, as vLLM 0.32's client runs it.

References: vLLM's benchmarks/lib/endpoint_request_func.py (async_request_openai_embeddings,
_run_pooling_request) and serve.py (the pooling report and result keys), and the console
output and result JSON of vLLM's own client in bench/results/embeddings-zen5-bf16-packed/.

The unit tests need no model; the fake-server test sends requests of which some answer 400;
the live tests run the bench against `python -m aioserve serve` on all-MiniLM-L6-v2,
started once for the module.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from aioserve import cli
from aioserve.benchmarks import pooling, serve
from aioserve.benchmarks.datasets import SampleRequest
from aioserve.benchmarks.endpoints import Target
from aioserve.benchmarks.statistics import RequestResult, latency_stats, report_row
from aioserve.config.declaration import ConfigError
from tests.server.serve_process import serve_model

RESULTS = Path(__file__).parents[2] / "bench/results/embeddings-zen5-bf16-packed"
MODEL = "minilm"


def _vllm_report_labels(log: str) -> list[str]:
    """The labels (first 40 columns) of the result block in one of vLLM's logs."""
    lines = (RESULTS / log).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if "Serving Benchmark Result" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i] == "=" * 50)
    return [line[:40].rstrip() for line in lines[start : end + 1]]


def _labels(report: str) -> list[str]:
    return [line[:40].rstrip() for line in report.splitlines()]


def _target(**fields) -> Target:
    base = dict(
        url="http://127.0.0.1:9/v1/embeddings",
        model="m",
        chat=False,
        headers={},
        extra_body={},
        ignore_eos=False,
        pooling=True,
    )
    return Target(**{**base, **fields})


# --- the payload, the batches, the checks -----------------------------------------------


def test_payload_is_vllms():
    request = SampleRequest("some text", 5, 128)
    assert pooling.embeddings_payload(_target(), request) == {
        "model": "m",
        "input": "some text",
        "truncate_prompt_tokens": -1,
    }
    # --ignore-eos is sent as vLLM's _update_payload_common sends it; --extra-body last, winning.
    payload = pooling.embeddings_payload(
        _target(ignore_eos=True, extra_body={"truncate_prompt_tokens": 8, "dimensions": 4}),
        request,
    )
    assert payload == {
        "model": "m",
        "input": "some text",
        "truncate_prompt_tokens": 8,
        "ignore_eos": True,
        "dimensions": 4,
    }


def test_batches_group_consecutive_prompts():
    requests = [SampleRequest(f"p{i}", 10 + i, 128) for i in range(5)]
    assert pooling.batch_requests(requests, 1) == requests
    batches = pooling.batch_requests(requests, 2)
    assert [b.prompt for b in batches] == [["p0", "p1"], ["p2", "p3"], ["p4"]]
    assert [b.prompt_len for b in batches] == [21, 25, 14]
    payload = pooling.embeddings_payload(_target(), batches[0])
    assert payload["input"] == ["p0", "p1"]


def test_url_check_says_what_vllm_says():
    pooling.check_url("openai-embeddings", "http://h:1/v1/embeddings")
    with pytest.raises(ConfigError, match=r"OpenAI Embeddings API URL must end with one of: "):
        pooling.check_url("openai-embeddings", "http://h:1/v1/completions")


def _args(**fields):
    import argparse

    base = dict(
        backend="openai-embeddings",
        dataset_name="random",
        random_batch_size=1,
        goodput=None,
        temperature=None,
        top_p=None,
        top_k=None,
        min_p=None,
        frequency_penalty=None,
        presence_penalty=None,
        repetition_penalty=None,
    )
    return argparse.Namespace(**{**base, **fields})


def test_batch_size_rules():
    pooling.check_options(_args(random_batch_size=4))
    for fields, message in (
        ({"random_batch_size": 0}, "at least 1"),
        ({"random_batch_size": 2, "backend": "openai"}, "only the embeddings backend"),
        ({"random_batch_size": 2, "dataset_name": "sharegpt"}, "random dataset's prompts only"),
    ):
        with pytest.raises(ConfigError, match=message):
            pooling.check_options(_args(**fields))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--endpoint", "/v1/completions"), "URL must end with one of: {'embeddings'}."),
        (("--logprobs", "1"), "--logprobs is sent with completions requests only"),
        (("--random-batch-size", "0"), "--random-batch-size must be at least 1"),
        (("--random-batch-size", "2", "--dataset-name", "sonnet"), "random dataset's"),
        (("--backend", "openai", "--random-batch-size", "2"), "only the embeddings backend"),
    ],
)
def test_refusals_come_before_anything_is_sent(capsys, options, message):
    argv = ["bench", "serve", "--backend", "openai-embeddings", "--base-url", "http://127.0.0.1:9"]
    assert cli.main([*argv, *options]) == 2
    assert message in capsys.readouterr().err


def test_notes_name_what_a_pooling_run_leaves_out():
    assert pooling.notes(_args(), ["e2el"]) == []
    said = pooling.notes(
        _args(temperature=0.0, top_k=5, goodput=["e2el:10"]), ["ttft", "e2el", "itl"]
    )
    assert said[0].startswith("--temperature, --top-k: not sent")
    assert said[1].startswith("--goodput: not measured")
    assert said[2].startswith("ttft, itl: not measured")


# --- metrics, report, result keys ------------------------------------------------------------


def _results() -> list[RequestResult]:
    ok = [
        RequestResult(success=True, prompt_len=128, latency=0.010 * (i + 1), start_time=i)
        for i in range(3)
    ]
    ok[2].num_input_sequences = 4
    failed = RequestResult(error="HTTP 400 Bad Request: no")
    return [*ok, failed]


def test_metrics_count_successful_requests_and_their_texts():
    metrics = pooling.pooling_metrics(_results(), 2.0, [50, 99])
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.total_input == 3 * 128
    assert metrics.total_input_sequences == 1 + 1 + 4
    assert metrics.request_throughput == 1.5
    assert metrics.input_sequence_throughput == 3.0
    assert metrics.total_token_throughput == 3 * 128 / 2.0
    # vLLM: np.mean / np.median / np.percentile of the successful latencies, in ms.
    latencies = np.array([0.01, 0.02, 0.03])
    assert metrics.e2el.mean == pytest.approx(np.mean(latencies) * 1000)
    assert metrics.e2el.percentiles[1][1] == pytest.approx(np.percentile(latencies, 99) * 1000)


@pytest.mark.parametrize(
    ("log", "max_concurrency"),
    [("vllm-r1-cinf-n256.log", None), ("vllm-r1-c1-n32.log", 1)],
)
def test_report_has_vllms_lines(log, max_concurrency):
    metrics = pooling.pooling_metrics(_results(), 2.0, [99])
    queue = serve.queue_latencies(_results(), [99], float("inf"), max_concurrency)
    text = pooling.report(
        metrics,
        2.0,
        request_rate=float("inf"),
        max_concurrency=max_concurrency,
        selected_metrics=["e2el"],
        extra_latencies=queue,
    )
    assert _labels(text) == _vllm_report_labels(log)
    assert "Input throughput (inputs/s):             3.00      " in text.splitlines()


def test_report_with_a_rate_and_queue_metrics():
    metrics = pooling.pooling_metrics(_results(), 2.0, [99])
    queue = serve.queue_latencies(_results(), [99], 5.0, 2)
    text = pooling.report(
        metrics,
        2.0,
        request_rate=5.0,
        max_concurrency=2,
        selected_metrics=["ttft", "e2el", "client_queue_time", "e2el_including_client_queue"],
        extra_latencies=queue,
    )
    labels = _labels(text)
    assert labels[3:5] == ["Maximum request concurrency:", "Request rate configured (RPS):"]
    assert "Mean TTFT (ms):" not in labels  # vLLM prints no generation metric for pooling
    blocks = [line.strip("-") for line in text.splitlines() if line.startswith("---")]
    assert blocks == [
        "End-to-end Latency",
        "Client-side Queueing",
        "Queue-inclusive End-to-end Latency",
    ]


def test_result_keys_are_vllms():
    results = _results()
    metrics = pooling.pooling_metrics(results, 2.0, [99])
    fields = pooling.result_fields(metrics, 2.0, results, ["e2el"])
    assert list(fields) == [
        "duration",
        "completed",
        "total_input_tokens",
        "total_input_sequences",
        "request_throughput",
        "input_sequence_throughput",
        "total_token_throughput",
        "input_lens",
        "latencies",
        "queue_times",
        "errors",
        "mean_e2el_ms",
        "median_e2el_ms",
        "std_e2el_ms",
        "p99_e2el_ms",
    ]
    assert fields["input_lens"] == [128, 128, 128, 0]  # a failed request's is 0, as in vLLM
    assert fields["errors"][-1].startswith("HTTP 400")
    assert fields["mean_e2el_ms"] == latency_stats([0.01, 0.02, 0.03], [99]).mean
    # A ramp-up's events come before the metrics, where vLLM's benchmark() adds them.
    events = [{"rps": 1, "timestamp": "t"}]
    keys = list(pooling.result_fields(metrics, 2.0, results, ["e2el"], rps_events=events))
    assert keys[keys.index("errors") + 1 : keys.index("errors") + 3] == [
        "rps_change_events",
        "mean_e2el_ms",
    ]


# --- the client against a fake server: failures are counted, not fatal --------------------


@pytest.fixture
def fake_embeddings():
    """A /v1/embeddings that answers 400 to an input containing "bad", 200 with usage
    otherwise (or a body that is not JSON for "garbage"); it records the bodies and headers."""
    seen: list[tuple[dict, dict]] = []

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((body, {k.lower(): v for k, v in request.headers.items()}))
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if any("bad" in t for t in texts):
            return web.json_response({"error": {"message": "no", "code": 400}}, status=400)
        if any("garbage" in t for t in texts):
            return web.Response(text="{not json", content_type="application/json")
        data = [{"index": i, "object": "embedding", "embedding": [0.0]} for i in range(len(texts))]
        tokens = sum(len(t.split()) for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return web.json_response({"object": "list", "data": data, "usage": usage})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner.addresses[0][1]

    port = loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1/embeddings", seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    loop.close()


def test_failing_requests_are_counted_and_the_run_goes_on(fake_embeddings):
    url, seen = fake_embeddings
    requests = [
        SampleRequest("one two three", 3, 0),
        SampleRequest("a bad one", 3, 0),
        SampleRequest("garbage here", 2, 0),
        SampleRequest(["four five", "six"], 3, 0),  # a batch: two texts
    ]
    target = _target(url=url, headers={"Authorization": "Bearer k"})
    results, duration = asyncio.run(
        serve.run_requests(
            target,
            requests,
            request_rate=float("inf"),
            burstiness=1.0,
            max_concurrency=2,
            rng=np.random.default_rng(0),
            request_id_prefix="r-",
            show_progress=False,
        )
    )
    assert [r.success for r in results] == [True, False, False, True]
    assert results[1].error.startswith("HTTP 400 Bad Request")
    assert results[2].error.startswith("JSONDecodeError")
    assert [r.prompt_len for r in results] == [3, 0, 0, 3]  # the server's usage
    assert results[3].num_input_sequences == 2
    assert all(r.latency > 0 for r in (results[0], results[3]))
    metrics = pooling.pooling_metrics(results, duration, [99])
    assert (metrics.completed, metrics.failed, metrics.total_input_sequences) == (2, 2, 3)
    bodies = {h["x-request-id"]: b for b, h in seen}
    assert bodies["r-0"] == {"model": "m", "input": "one two three", "truncate_prompt_tokens": -1}
    assert all(h["authorization"] == "Bearer k" for _, h in seen)


# --- against `python -m aioserve serve` on all-MiniLM-L6-v2 -------------------------------


@pytest.fixture(scope="module")
def minilm_server(minilm_folder, tmp_path_factory):
    """`python -m aioserve serve` on all-MiniLM-L6-v2 under vLLM's samples' name, on a free
    port of 127.0.0.1; killed at the end."""
    log = tmp_path_factory.mktemp("bench-minilm") / "serve.log"
    with serve_model(minilm_folder, MODEL, log, "--enforce-eager") as url:
        yield url


def _bench(url: str, tmp_path: Path, *options: str) -> tuple[list[str], dict]:
    argv = [
        "bench", "serve", "--backend", "openai-embeddings", "--base-url", url,
        "--dataset-name", "random", "--random-input-len", "128", "--num-prompts", "16",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--disable-tqdm", *options,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    return argv, json.loads((tmp_path / "r.json").read_text())


def _prompts(argv: list[str]) -> list[str]:
    """The prompts `bench serve` built for `argv`: the same workload, built again."""
    from aioserve.benchmarks.workload import load_tokenizer, serve_requests

    args = cli.build_parser().parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    return [r.prompt for r in serve_requests(args, tokenizer, chat=False)]


def test_bench_embeddings_as_vllm_reports_it(minilm_server, minilm_folder, tmp_path, capsys):
    argv, result = _bench(
        minilm_server, tmp_path, "--model", MODEL, "--tokenizer", str(minilm_folder),
        "--max-concurrency", "4",
    )  # fmt: skip
    out = capsys.readouterr().out
    block = out[out.index("=" * 12 + " Serving Benchmark Result") :]
    assert _labels(block)[: len(_vllm_report_labels("vllm-r1-c1-n32.log"))] == (
        _vllm_report_labels("vllm-r1-c1-n32.log")
    )
    # vLLM's own client's result of the same kind of run (--max-concurrency, no details).
    vllm_keys = list(json.loads((RESULTS / "vllm-r1-c1-n32.json").read_text()))
    assert list(result) == vllm_keys
    assert result["completed"] == 16 and result["total_input_sequences"] == 16
    assert result["backend"] == result["endpoint_type"] == "openai-embeddings"
    # The server's usage.prompt_tokens: what the tokenizer gives, special tokens included.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    counts = [len(tokenizer(p).input_ids) for p in _prompts(argv)]
    assert counts == [128] * 16
    assert result["total_input_tokens"] == sum(counts)
    assert result["request_throughput"] == pytest.approx(16 / result["duration"])
    assert result["total_token_throughput"] == pytest.approx(sum(counts) / result["duration"])
    assert 0 < result["median_e2el_ms"] <= result["p99_e2el_ms"]


def test_batches_and_the_first_model(minilm_server, minilm_folder, tmp_path, capsys):
    """No --model: the first of /v1/models and its root as the tokenizer, as vLLM does;
    --random-batch-size 4: four requests of four texts each."""
    argv, result = _bench(minilm_server, tmp_path, "--random-batch-size", "4", "--save-detailed")
    assert "First model name: minilm" in capsys.readouterr().out
    assert (result["completed"], result["total_input_sequences"]) == (4, 16)
    assert result["input_sequence_throughput"] == pytest.approx(16 / result["duration"])
    assert result["input_lens"] == [4 * 128] * 4
    assert result["errors"] == [""] * 4


def test_refused_requests_count_as_failed(minilm_server, minilm_folder, tmp_path, capsys):
    """The server answers 400 to `dimensions` for a model that is not matryoshka: every
    request fails, the run still completes and says so."""
    _, result = _bench(
        minilm_server, tmp_path, "--model", MODEL, "--tokenizer", str(minilm_folder),
        "--num-prompts", "3", "--extra-body", '{"dimensions": 8}', "--save-detailed",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert report_row("Failed requests:", 3, False) in out.splitlines()
    assert result["completed"] == 0 and "failed" not in result  # vLLM's pooling keys
    assert all(error.startswith("HTTP 400") for error in result["errors"])
    assert result["input_lens"] == [0, 0, 0]
