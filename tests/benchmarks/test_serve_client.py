"""`aioserve bench serve` against a fake OpenAI server: payloads, SSE parsing, counts, limits.

The fake streams one chunk per token, each chunk cut in two TCP writes, with an SSE
comment first and a usage chunk last, as an OpenAI-compatible server does. It records
what it received and how many requests it had in flight at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from aioserve import cli

MODEL = "fake-model"
CHAT_PROMPT_TOKENS = 100


@dataclass
class FakeServer:
    root: str  # what /v1/models reports as the model's root: the tokenizer's folder
    bodies: list[dict] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0
    port: int = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "root": self.root}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.paths.append(request.path)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if body.get("fail"):
                return web.json_response({"error": {"message": "no", "code": 400}}, status=400)
            if body.get("garbage"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: {broken\n\n')
                await response.write_eof()
                return response
            chat = request.path.endswith("/chat/completions")
            tokens = body["max_completion_tokens" if chat else "max_tokens"]
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b": ping\n\n")
            chunks = [{"delta": {"role": "assistant", "content": ""}}] if chat else []
            for i in range(tokens):
                piece = f" w{i}"
                chunks.append({"delta": {"content": piece}} if chat else {"text": piece})
            usage = {"completion_tokens": tokens}
            if chat:
                usage["prompt_tokens"] = CHAT_PROMPT_TOKENS
            events = [{"choices": [{"index": 0, **c}]} for c in chunks] + [
                {"choices": [], "usage": usage}
            ]
            for event in events:
                data = f"data: {json.dumps(event)}\n\n".encode()
                await response.write(data[:10])
                await asyncio.sleep(0.002)
                await response.write(data[10:])
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server(tiny_model):
    server = FakeServer(root=tiny_model)
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/completions", server.generate)
    app.router.add_post("/v1/chat/completions", server.generate)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        server.port = runner.addresses[0][1]

    loop.run_until_complete(start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield server
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    loop.close()


def bench_serve(server: FakeServer, tmp_path, *options: str) -> dict:
    argv = [
        "bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}",
        "--dataset-name", "random", "--random-input-len", "20", "--random-output-len", "4",
        "--num-prompts", "3", "--save-result", "--save-detailed",
        "--result-dir", str(tmp_path), "--result-filename", "result.json", *options,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads((tmp_path / "result.json").read_text())


def test_completions_run(fake_server, tmp_path, capsys):
    result = bench_serve(fake_server, tmp_path, "--temperature", "0.5")
    out = capsys.readouterr().out
    assert "First model name: fake-model" in out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    assert fake_server.paths == ["/v1/completions"] * 3
    for body in fake_server.bodies:
        assert body["model"] == MODEL
        assert body["max_tokens"] == 4
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True  # random prompts run to their length
        assert body["temperature"] == 0.5
    assert (result["completed"], result["failed"]) == (3, 0)
    assert result["total_input_tokens"] == 3 * 20
    assert result["total_output_tokens"] == 3 * 4
    assert result["output_lens"] == [4, 4, 4]
    assert result["generated_texts"] == [" w0 w1 w2 w3"] * 3
    assert all(len(itl) == 3 for itl in result["itls"])  # 4 chunks, 3 gaps
    assert all(0 < ttft < result["duration"] for ttft in result["ttfts"])
    for key in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{key}_ms" in result
    assert "mean_e2el_ms" not in result
    assert result["request_rate"] == "inf"
    assert result["model_id"] == fake_server.root
    assert result["output_throughput"] == pytest.approx(12 / result["duration"])


def test_chat_run_with_selected_metrics(fake_server, tmp_path):
    result = bench_serve(
        fake_server,
        tmp_path,
        "--backend", "openai-chat", "--model", MODEL, "--tokenizer", fake_server.root,
        "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90",
    )  # fmt: skip
    assert fake_server.paths == ["/v1/chat/completions"] * 3
    body = fake_server.bodies[0]
    assert body["max_completion_tokens"] == 4
    assert body["messages"][0]["role"] == "user"
    assert result["total_input_tokens"] == 3 * CHAT_PROMPT_TOKENS  # the server's usage wins
    assert result["total_output_tokens"] == 3 * 4
    assert result["generated_texts"] == [" w0 w1 w2 w3"] * 3
    assert {"p50_ttft_ms", "p90_ttft_ms", "p50_e2el_ms", "p90_e2el_ms"} <= set(result)
    assert "mean_tpot_ms" not in result and "p99_ttft_ms" not in result


def test_max_concurrency_caps_requests_in_flight(fake_server, tmp_path):
    result = bench_serve(
        fake_server, tmp_path, "--max-concurrency", "1", "--num-prompts", "4",
        "--request-rate", "200", "--burstiness", "0.5",
    )  # fmt: skip
    assert fake_server.most_in_flight == 1
    assert result["completed"] == 4
    assert result["max_concurrency"] == 1
    # vLLM counts the requests active within one second: all four, one after another.
    assert result["max_concurrent_requests"] == 4


def test_failed_requests_are_counted_not_fatal(fake_server, tmp_path, capsys):
    result = bench_serve(fake_server, tmp_path, "--extra-body", '{"fail": true}')
    assert (result["completed"], result["failed"]) == (0, 3)
    assert result["total_output_tokens"] == 0
    assert all(error.startswith("HTTP 400") for error in result["errors"])
    assert "Failed requests (3)" in capsys.readouterr().out


def test_a_broken_stream_fails_its_request(fake_server, tmp_path):
    result = bench_serve(fake_server, tmp_path, "--extra-body", '{"garbage": true}')
    assert (result["completed"], result["failed"]) == (0, 3)
    assert all(error.startswith("JSONDecodeError") for error in result["errors"])


def test_bad_options_are_refused(fake_server, capsys):
    base = [
        "bench",
        "serve",
        "--base-url",
        f"http://127.0.0.1:{fake_server.port}",
        "--model",
        MODEL,
    ]
    assert cli.main([*base, "--max-concurrency", "0"]) == 2
    assert "--max-concurrency must be at least 1" in capsys.readouterr().err
    assert cli.main([*base, "--percentile-metrics", "ttft,speed"]) == 2
    assert "unknown metric(s) speed" in capsys.readouterr().err
    assert cli.main([*base, "--dataset-name", "hf"]) == 2
    assert "Hugging Face hub" in capsys.readouterr().err
    assert fake_server.bodies == []


def test_unreachable_server(tmp_path, capsys):
    assert cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9"]) == 2
    assert "cannot list the models" in capsys.readouterr().err


def bench_serve_plain(server: FakeServer, tmp_path, *options: str) -> dict:
    """bench_serve without --save-detailed."""
    argv = [
        "bench", "serve", "--base-url", f"http://127.0.0.1:{server.port}",
        "--dataset-name", "random", "--random-input-len", "20", "--random-output-len", "4",
        "--num-prompts", "3", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "result.json", *options,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    return json.loads((tmp_path / "result.json").read_text().splitlines()[-1])


def test_completions_carry_vllms_fixed_fields(fake_server, tmp_path):
    """lib/endpoint_request_func.py:async_request_openai_completions sends
    repetition_penalty 1.0 and logprobs before merging --extra-body."""
    bench_serve_plain(fake_server, tmp_path)
    assert all(b["repetition_penalty"] == 1.0 and b["logprobs"] is None for b in fake_server.bodies)
    fake_server.bodies.clear()
    bench_serve_plain(
        fake_server, tmp_path, "--logprobs", "2", "--extra-body", '{"repetition_penalty": 1.2}'
    )
    assert all(b["repetition_penalty"] == 1.2 and b["logprobs"] == 2 for b in fake_server.bodies)
    fake_server.bodies.clear()
    bench_serve_plain(fake_server, tmp_path, "--backend", "openai-chat", "--num-prompts", "1")
    assert "logprobs" not in fake_server.bodies[-1]
    assert "repetition_penalty" not in fake_server.bodies[-1]


def test_saved_keys_and_goodput_as_vllm(fake_server, tmp_path, capsys):
    """serve.py:benchmark always saves request_goodput (null without --goodput),
    latencies, queue_times and rtfx; --save-detailed absent drops only the other lists."""
    result = bench_serve_plain(fake_server, tmp_path)
    assert result["request_goodput"] is None
    assert len(result["latencies"]) == len(result["queue_times"]) == 3
    assert result["rtfx"] == 0.0
    for name in ("input_lens", "output_lens", "ttfts", "itls", "start_times", "errors"):
        assert name not in result
    assert "Request goodput" not in capsys.readouterr().out
    result = bench_serve_plain(fake_server, tmp_path, "--goodput", "e2el:60000", "ttft:60000")
    assert result["request_goodput"] == pytest.approx(3 / result["duration"])
    assert "Request goodput (req/s):" in capsys.readouterr().out
    result = bench_serve_plain(fake_server, tmp_path, "--goodput", "ttft:0")
    assert result["request_goodput"] == 0.0


def test_vllm_options_are_accepted(fake_server, tmp_path, capsys):
    result = bench_serve_plain(
        fake_server, tmp_path,
        "--trust-remote-code", "--tokenizer-mode", "hf",
        "--random-range-ratio", '{"input": 0.2, "output": 0.5}',
        "--metric-percentiles", "0,50,100", "--ready-check-timeout-sec", "5",
        "--max-concurrency", "1", "--request-rate", "300",
        "--percentile-metrics", "ttft,client_queue_time,e2el_including_client_queue",
    )  # fmt: skip
    assert {"p0_ttft_ms", "p100_ttft_ms", "mean_client_queue_time_ms"} <= set(result)
    assert "p100_e2el_including_client_queue_ms" in result
    out = capsys.readouterr().out
    assert "Initial test run completed." in out and "P100 TTFT (ms):" in out
    assert "Mean Client Queue Time (ms):" in out
    assert {b["max_tokens"] for b in fake_server.bodies} <= {2, 3, 4, 5, 6}


def test_append_result_adds_a_line(fake_server, tmp_path):
    bench_serve_plain(fake_server, tmp_path, "--label", "one")
    bench_serve_plain(fake_server, tmp_path, "--append-result", "--label", "two")
    lines = (tmp_path / "result.json").read_text().splitlines()
    assert [json.loads(line)["label"] for line in lines] == ["one", "two"]


def test_ramp_up(fake_server, tmp_path, capsys):
    result = bench_serve_plain(
        fake_server, tmp_path, "--num-prompts", "4",
        "--ramp-up-strategy", "linear", "--ramp-up-start-rps", "100", "--ramp-up-end-rps", "400",
    )  # fmt: skip
    assert result["ramp_up_strategy"] == "linear"
    assert (result["ramp_up_start_rps"], result["ramp_up_end_rps"]) == (100, 400)
    # rates 100, 200, 300, 400: one event per whole RPS reached, from the start rate
    assert [e["rps"] for e in result["rps_change_events"]] == list(range(100, 401))
    assert "Traffic ramp-up strategy: linear." in capsys.readouterr().out


def test_custom_dataset_over_http(fake_server, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Why is the sky blue?", "output_tokens": 3}\n')
    result = bench_serve_plain(
        fake_server, tmp_path, "--dataset-name", "custom", "--dataset-path", str(path),
        "--custom-output-len", "-1", "--skip-chat-template", "--num-prompts", "2",
    )  # fmt: skip
    assert result["completed"] == 2
    assert [b["prompt"] for b in fake_server.bodies] == ["Why is the sky blue?"] * 2
    assert [b["max_tokens"] for b in fake_server.bodies] == [3, 3]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--tokenizer-mode", "mistral"), "--tokenizer-mode mistral"),
        (("--backend", "openai-chat", "--logprobs", "1"), "--logprobs"),
        (("--goodput", "speed:1"), "Invalid metric name found"),
        (("--metric-percentiles", "101"), "from 0 to 100"),
        (("--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"), "both --ramp-up-start"),
        (
            (
                "--ramp-up-strategy",
                "linear",
                "--ramp-up-start-rps",
                "1",
                "--ramp-up-end-rps",
                "2",
                "--request-rate",
                "3",
            ),
            "do not specify --request-rate",
        ),  # fmt: skip
    ],
)
def test_more_refusals(fake_server, capsys, options, message):
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{fake_server.port}", *options]
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert fake_server.bodies == []


def test_responses_backend_is_refused(capsys):
    """aioserve serves no /v1/responses, so vLLM's openai-responses backend stays refused."""
    with pytest.raises((SystemExit, argparse.ArgumentError)) as error:
        cli.main(["bench", "serve", "--backend", "openai-responses"])
    assert "openai-responses" in str(error.value) + capsys.readouterr().err


def test_lora_modules_name_the_model_of_each_request(fake_server, tmp_path):
    """vLLM's benchmark sends each request to one of --lora-modules: in turn, or at random."""
    options = ("--num-prompts", "5", "--lora-modules", "sql", "chat", "--max-concurrency", "1")
    bench_serve(fake_server, tmp_path, *options, "--lora-assignment", "round-robin")
    assert [b["model"] for b in fake_server.bodies] == ["sql", "chat", "sql", "chat", "sql"]
    fake_server.bodies.clear()
    bench_serve(fake_server, tmp_path, *options, "--seed", "3")
    drawn = [b["model"] for b in fake_server.bodies]
    assert set(drawn) <= {"sql", "chat"} and len(drawn) == 5
    fake_server.bodies.clear()
    bench_serve(fake_server, tmp_path, *options, "--seed", "3")
    assert [b["model"] for b in fake_server.bodies] == drawn  # seeded
