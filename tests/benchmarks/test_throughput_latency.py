"""`aioserve bench throughput` and `bench latency` end to end, on the tiny model."""

from __future__ import annotations

import argparse
import json
import re

import pytest

from aioserve import cli
from aioserve.benchmarks import datasets
from aioserve.benchmarks.workload import random_lengths
from tests.lora_adapters import make_lora_adapter

THROUGHPUT_KEYS = {
    "model_id",
    "elapsed_time",
    "num_requests",
    "total_num_tokens",
    "requests_per_second",
    "tokens_per_second",
}
LINE = re.compile(
    r"Throughput: ([\d.]+) requests/s, ([\d.]+) total tokens/s, ([\d.]+) output tokens/s"
)


def throughput(tiny_model, tmp_path, capsys, *options: str) -> tuple[dict, dict[str, int], str]:
    path = tmp_path / "throughput.json"
    argv = [
        "bench", "throughput", "--model", tiny_model, "--max-model-len", "512",
        "--dataset-name", "random", "--input-len", "24", "--output-len", "5",
        "--num-prompts", "3", "--output-json", str(path), "--enforce-eager", *options,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    counts = {
        kind: int(n) for kind, n in re.findall(r"Total num (prompt|output) tokens:\s+(\d+)", out)
    }
    return json.loads(path.read_text()), counts, out


def check_figures(result: dict, out: str) -> None:
    assert set(result) == THROUGHPUT_KEYS
    assert next(iter(result)) == "model_id"  # throughput.py:main writes it first
    elapsed = result["elapsed_time"]
    assert result["requests_per_second"] == pytest.approx(result["num_requests"] / elapsed)
    assert result["tokens_per_second"] == pytest.approx(result["total_num_tokens"] / elapsed)
    requests_per_s, total_per_s, _ = map(float, LINE.search(out).groups())
    assert requests_per_s == pytest.approx(result["requests_per_second"], abs=0.01)
    assert total_per_s == pytest.approx(result["tokens_per_second"], abs=0.01)


@pytest.mark.parametrize(
    "options",
    [(), ("--backend", "vllm"), ("--backend", "hf", "--hf-max-batch-size", "2")],
    ids=["aioserve", "vllm-alias", "hf"],
)
def test_throughput_counts_every_token(tiny_model, tmp_path, capsys, options):
    result, counts, out = throughput(tiny_model, tmp_path, capsys, *options)
    check_figures(result, out)
    assert result["num_requests"] == 3
    assert counts == {"prompt": 3 * 24, "output": 3 * 5}
    assert result["total_num_tokens"] == 3 * (24 + 5)


def test_throughput_async_engine_with_n(tiny_model, tmp_path, capsys):
    result, counts, out = throughput(
        tiny_model, tmp_path, capsys, "--async-engine", "--n", "2", "--disable-detokenize"
    )
    check_figures(result, out)
    assert counts == {"prompt": 3 * 24, "output": 3 * 2 * 5}


def test_throughput_chat_backend_counts_the_template(tiny_model, tokenizer, tmp_path, capsys):
    result, counts, out = throughput(tiny_model, tmp_path, capsys, "--backend", "vllm-chat")
    check_figures(result, out)
    prompts = [r.prompt for r in datasets.random_requests(tokenizer, 3, 24, 5, seed=0)]
    templated = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in prompts
    ]
    assert counts == {"prompt": sum(map(len, templated)), "output": 3 * 5}


def test_throughput_sharegpt_with_output_override(tiny_model, tokenizer, tmp_path, capsys):
    path = tmp_path / "sharegpt.json"
    conversation = {
        "conversations": [
            {"value": "What do bees make from the nectar of flowers?"},
            {"value": "Honey, which they store in wax combs."},
        ]
    }
    path.write_text(json.dumps([conversation]))
    result, counts, _ = throughput(
        tiny_model, tmp_path, capsys, "--dataset-name", "sharegpt", "--dataset-path", str(path)
    )
    prompt_len = len(tokenizer(conversation["conversations"][0]["value"]).input_ids)
    assert counts == {"prompt": 3 * prompt_len, "output": 3 * 5}
    assert result["total_num_tokens"] == 3 * (prompt_len + 5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--backend", "mii"), "mii"),
        (("--lora-path", "adapter"), "--lora-path needs --enable-lora"),
        (("--enable-lora",), "LoRA path must be provided when enable_lora is True"),
        (
            ("--enable-lora", "--lora-path", "a", "--backend", "hf", "--hf-max-batch-size", "2"),
            "LoRA benchmarking is only supported for the aioserve (vllm) backend",
        ),
        (("--backend", "hf"), "--hf-max-batch-size"),
        (
            ("--backend", "hf", "--hf-max-batch-size", "2", "--pt-load-map-location", "cuda"),
            "takes no --ignore-patterns or --pt-load-map-location",
        ),
        (("--hf-max-batch-size", "4"), "only for --backend hf"),
        (("--dataset-name", "hf"), "Hugging Face hub"),
        (("--num-prompts", "0"), "--num-prompts must be at least 1"),
    ],
)
def test_throughput_refusals(tiny_model, tmp_path, capsys, options, message):
    argv = ["bench", "throughput", "--model", tiny_model, "--input-len", "8", *options]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_random_lengths_precedence():
    """vLLM's --random-* options win over --input-len/--output-len/--prefix-len, which
    (unlike vLLM, which ignores them) win over the defaults 1024/128/0."""
    throughput_parser = cli.build_parser()._subparsers._group_actions[0].choices["bench"]
    parser = throughput_parser._subparsers._group_actions[0].choices["throughput"]
    assert random_lengths(parser.parse_args([])) == (1024, 128, 0)
    plain = ["--input-len", "24", "--output-len", "5", "--prefix-len", "3"]
    assert random_lengths(parser.parse_args(plain)) == (24, 5, 3)
    both = [*plain, "--random-input-len", "30", "--random-output-len", "6"]
    assert random_lengths(parser.parse_args([*both, "--random-prefix-len", "0"])) == (30, 6, 0)


def test_throughput_random_options_and_warmups(tiny_model, tmp_path, capsys):
    result, counts, out = throughput(
        tiny_model, tmp_path, capsys,
        "--random-input-len", "20", "--random-output-len", "4", "--num-warmups", "2",
    )  # fmt: skip
    check_figures(result, out)
    assert "Warming up with 2 requests..." in out
    assert counts == {"prompt": 3 * 20, "output": 3 * 4}  # the warm-up is not counted
    assert result["model_id"] == tiny_model


def test_throughput_request_longer_than_the_context(tiny_model, capsys):
    argv = ["bench", "throughput", "--model", tiny_model, "--max-model-len", "64",
            "--input-len", "60", "--output-len", "8", "--num-prompts", "1",
            "--enforce-eager"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "needs 68 tokens" in capsys.readouterr().err


def test_latency(tiny_model, tmp_path, capsys):
    path = tmp_path / "latency.json"
    argv = [
        "bench", "latency", "--model", tiny_model, "--max-model-len", "512",
        "--input-len", "16", "--output-len", "4", "--batch-size", "2",
        "--num-iters-warmup", "1", "--num-iters", "2", "--output-json", str(path),
        "--enforce-eager",
    ]  # fmt: skip
    assert cli.main(argv) == 0
    result = json.loads(path.read_text())
    assert set(result) == {"model_id", "avg_latency", "std_latency", "latencies", "percentiles"}
    assert next(iter(result)) == "model_id" and result["model_id"] == tiny_model
    first, second = result["latencies"]
    low, high = sorted((first, second))
    assert result["avg_latency"] == pytest.approx((first + second) / 2)
    assert result["std_latency"] == pytest.approx(abs(first - second) / 2)
    # with two values, the p-th percentile is low + p/100 * (high - low)
    expected = {str(p): low + p / 100 * (high - low) for p in (10, 25, 50, 75, 90, 99)}
    assert result["percentiles"] == pytest.approx(expected)
    out = capsys.readouterr().out
    assert f"Avg latency: {result['avg_latency']} seconds" in out
    assert "99% percentile latency:" in out


def test_latency_refuses_zero_iterations(tiny_model, capsys):
    assert cli.main(["bench", "latency", "--model", tiny_model, "--num-iters", "0"]) == 2
    assert "--num-iters must be at least 1" in capsys.readouterr().err


def test_throughput_through_lora_adapters(tiny_model, tmp_path, capsys):
    adapter = make_lora_adapter(tiny_model, tmp_path / "adapter", rank=8)
    options = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
    options += ("--lora-path", adapter, "--lora-assignment", "round-robin")
    result, counts, out = throughput(tiny_model, tmp_path, capsys, *options)
    check_figures(result, out)
    assert counts["output"] == 3 * 5


@pytest.mark.parametrize(
    ("assignment", "expected"), [("round-robin", [1, 2, 3, 1, 2]), ("random", None)]
)
def test_lora_ids_are_assigned_as_vllms_benchmark_does(assignment, expected):
    from aioserve.benchmarks.throughput import lora_requests

    args = argparse.Namespace(lora_path="/adapter", lora_assignment=assignment)
    loras = lora_requests(args, 5, max_loras=3, seed=0)
    ids = [lora.lora_int_id for lora in loras]
    assert all(lora.lora_name == str(lora.lora_int_id) for lora in loras)
    assert all(lora.lora_path == "/adapter" for lora in loras)
    if expected is not None:
        assert ids == expected
    else:
        assert set(ids) <= {1, 2, 3}
        assert ids == [lora.lora_int_id for lora in lora_requests(args, 5, 3, seed=0)]
    no_path = argparse.Namespace(lora_path=None, lora_assignment=assignment)
    assert lora_requests(no_path, 2, 3, 0) == [None, None]
