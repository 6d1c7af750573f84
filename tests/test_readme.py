"""Every command README.md shows, run as a new user would run it.

The commands are read from README.md itself, so this test follows the README when it
changes. The Quick start's server command starts one server (its port moved off 8000 to a
free one: every server in the tests listens on a port it picks); the curl commands, the
`openai` example and `bench serve` talk to it. The offline example runs in its own process,
before the server starts, so that two models are never loaded at once.
The offline bench commands keep every flag the README gives them and get a smaller
workload appended (argparse keeps an option's last value): what is checked is that each
runs as written — arguments, dependencies, output — not how long 64 prompts take.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.child_process import die_with_parent
from tests.server.serve_process import free_port, wait_until_healthy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_ADDRESS = "127.0.0.1:8000"
COMMAND_LIMIT_S = 600
ENVIRONMENT = {
    **{k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"},
    # A 1 GiB KV cache, not the default 4: the server runs beside the other commands, and
    # the test process has grown by the end of the suite (an environment setting, not a
    # change to any command; the ready line names it).
    "VLLM_CPU_KVCACHE_SPACE": "1",
}
SMALLER_WORKLOADS = {
    "throughput": ["--num-prompts", "4", "--input-len", "32", "--output-len", "8"],
    "latency": ["--batch-size", "2", "--input-len", "16", "--output-len", "4"]
    + ["--num-iters-warmup", "1", "--num-iters", "2"],
    "serve": ["--num-prompts", "4", "--random-input-len", "32", "--random-output-len", "8"],
}


def code_blocks(language: str) -> list[str]:
    """The README's fenced blocks in `language`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", README, flags=re.M | re.S)


def shell_commands(block: str) -> list[str]:
    """The commands of a bash block: lines joined until their quotes close."""
    commands, pending = [], ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending)
        except ValueError:  # a quote is still open: the command goes on
            continue
        commands.append(pending)
        pending = ""
    assert not pending, f"unterminated command in README.md: {pending!r}"
    return commands


def argv_of(command: str) -> list[str]:
    """A `python ...` or `curl ...` command as an argv, this test's Python running it."""
    argv = shlex.split(command)
    return [sys.executable, *argv[1:]] if argv[0] == "python" else argv


def run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=COMMAND_LIMIT_S, env=ENVIRONMENT, **kwargs
    )


def quick_start() -> tuple[str, str]:
    """The Quick start's two commands: install and serve, install and test."""
    serve, test = code_blocks("bash")[:2]
    return serve.strip(), test.strip()


def bench_commands() -> dict[str, str]:
    """The Benchmarks section's commands, by their `bench` subcommand (and backend)."""
    block = next(b for b in code_blocks("bash") if "aioserve bench" in b)
    commands = {}
    for command in shell_commands(block):
        argv = shlex.split(command)
        name = argv[4] + (" hf" if "--backend" in argv and "hf" in argv else "")
        commands[name] = command
    return commands


# --- the Quick start --------------------------------------------------------------------------


def test_the_test_command_is_the_one_ci_runs():
    _, test = quick_start()
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == test


def test_the_serve_command_installs_what_the_tests_install_without_their_extra():
    serve, test = quick_start()
    *install, _ = serve.split(" && ")
    *test_install, _ = test.split(" && ")
    assert install == [part.replace('".[test]"', ".") for part in test_install]


def test_the_virtual_environment_command_makes_one(tmp_path):
    command = re.search(r"\(`(python3 -m venv [^`]*)`\)", README.replace("\n", " ")).group(1)
    assert command == "python3 -m venv .venv && . .venv/bin/activate", "update this test"
    done = run(
        ["bash", "-c", command + " && python -c 'import sys; print(sys.prefix)'"], cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / ".venv")


# --- the offline commands ----------------------------------------------------------------------


def test_the_offline_example_prints_its_outputs():
    example = code_blocks("python")[1]
    assert "from aioserve import LLM" in example
    done = run([sys.executable, "-c", example], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.strip().splitlines()
    assert len(printed) >= 2 and printed[-1].endswith(("length", "stop")), done.stdout


@pytest.mark.parametrize("name", ["throughput", "throughput hf", "latency"])
def test_the_offline_bench_command_runs(name):
    command = bench_commands()[name]
    done = run(argv_of(command) + SMALLER_WORKLOADS[name.split()[0]], cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"Throughput: [\d.]+ requests/s|Avg latency: [\d.]+", done.stdout), done.stdout


def test_every_bench_command_is_tested():
    assert set(bench_commands()) == {"throughput", "throughput hf", "latency", "serve"}


def inline_commands() -> list[str]:
    """The `python -m aioserve ...` commands the prose shows that print and exit."""
    spans = re.findall(r"`(python -m aioserve [^`]*)`", README)
    return sorted({s for s in spans if "--help" in s or s.endswith("collect-env")})


@pytest.mark.parametrize("command", inline_commands())
def test_each_inline_command_runs(command):
    done = run(argv_of(command), cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()


# --- the embedding model ------------------------------------------------------------------------


def test_the_embedding_commands_get_their_answers(tmp_path):
    """The Embedding models section's server (on a free port) and its curl commands; it
    runs before the Quick start's server starts, so that two servers never run at once."""
    block = next(b for b in code_blocks("bash") if "all-MiniLM-L6-v2" in b)
    serve, embeddings, rerank = shell_commands(block)
    assert serve == "python -m aioserve serve --model sentence-transformers/all-MiniLM-L6-v2"
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            argv_of(serve) + ["--host", "127.0.0.1", "--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=ENVIRONMENT,
            preexec_fn=die_with_parent,
        )
    try:
        wait_until_healthy(process, f"http://{address}", log)
        answers = []
        for command in (embeddings, rerank):
            done = run(argv_of(command.replace(README_ADDRESS, address)))
            assert done.returncode == 0, done.stderr
            answers.append(json.loads(done.stdout))
    finally:
        process.kill()
        process.wait(timeout=30)
    vectors = [item["embedding"] for item in answers[0]["data"]]
    assert [len(v) for v in vectors] == [384, 384], answers[0]
    assert sum(x * x for x in vectors[0]) == pytest.approx(1.0, abs=1e-3)
    ranked = [result["document"]["text"] for result in answers[1]["results"]]
    assert ranked == ["A man is eating food.", "A horse runs."], answers[1]
    assert "no KV cache (an encoder-only model)" in log.read_text()


# --- the server and what talks to it ---------------------------------------------------------


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory) -> Iterator[str]:
    """The Quick start's server, as written but for its port; its address."""
    serve, _ = quick_start()
    command = serve.split(" && ")[-1]
    assert command == "python -m aioserve serve --host 127.0.0.1", "update this test"
    port = free_port()
    log = tmp_path_factory.mktemp("readme") / "serve.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            argv_of(command) + ["--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=ENVIRONMENT,
            preexec_fn=die_with_parent,
        )
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}", log)
        yield f"127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait(timeout=30)
    # The ready line the README shows, for the default model, in its shape.
    assert re.search(
        r"aioserve ready in [\d.]+ s: HuggingFaceTB/SmolLM2-135M-Instruct, GGUF Q4_1 .*"
        r"; KV cache [\d.]+ [MG]iB .* set by VLLM_CPU_KVCACHE_SPACE \(1 GiB\); "
        r"resident memory [\d.]+ [MG]iB",
        log.read_text(),
    ), log.read_text()[-3000:]


def curl_commands() -> list[str]:
    block = next(b for b in code_blocks("bash") if b.startswith("curl "))
    return shell_commands(block)


@pytest.mark.parametrize(
    "command", curl_commands(), ids=lambda c: re.search(r"8000(\S*)", c).group(1)
)
def test_each_curl_command_gets_its_answer(readme_server, command):
    done = run(argv_of(command.replace(README_ADDRESS, readme_server)))
    assert done.returncode == 0, done.stderr
    if '"stream": true' in command:
        events = [line for line in done.stdout.splitlines() if line]
        assert events[-1] == "data: [DONE]", done.stdout
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), done.stdout
        return
    answer = json.loads(done.stdout)
    assert "error" not in answer, answer
    if "/v1/models" in command:
        assert [m["id"] for m in answer["data"]] == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    elif "/chat/completions" in command:
        assert answer["choices"][0]["message"]["content"], answer
    elif "/tokenize" in command:
        assert answer["count"] == len(answer["tokens"]) > 0, answer


def test_the_openai_example_prints_a_reply_and_a_stream(readme_server):
    example = code_blocks("python")[0]
    assert "from openai import OpenAI" in example
    done = run([sys.executable, "-c", example.replace(README_ADDRESS, readme_server)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"


def test_the_bench_serve_command_measures_the_server(readme_server):
    command = bench_commands()["serve"].replace(README_ADDRESS, readme_server)
    done = run(argv_of(command) + SMALLER_WORKLOADS["serve"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"Successful requests:\s+4\s*\n", done.stdout), done.stdout
