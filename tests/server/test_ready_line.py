"""The ready line of `aioserve serve`: the time since the process started, the engine's load
report and the resident memory. (test_serve_command.py checks it in a real server's log.)"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time

import pytest
import torch

from aioserve.engine.load_report import build_load_report
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.models.checkpoint import open_checkpoint
from aioserve.server import serve
from aioserve.server.serve import ready_line, seconds_since_start
from tests.runner.plans import tiny_runner


def test_the_ready_line_shows_the_report_time_and_resident_memory(tmp_path):
    hf, runner = tiny_runner(num_blocks=16)
    hf.save_pretrained(tmp_path)
    report = build_load_report(
        "tiny", open_checkpoint(str(tmp_path)), runner, "VLLM_CPU_KVCACHE_SPACE (4 GiB)"
    )
    settings = engine_parts_around(runner, vocab_size=256, num_blocks=16, max_model_len=64).settings
    with_report = dataclasses.replace(settings, load_report=report)

    line = ready_line(with_report, 38.24)
    assert line.startswith(f"aioserve ready in 38.2 s: {report.describe()}; resident memory ")
    assert re.search(r"; resident memory [\d.]+ (MiB|GiB)$", line), line
    # An engine around a stand-in runner has no report: the time and the memory remain.
    assert re.fullmatch(
        r"aioserve ready in 1\.0 s; resident memory [\d.]+ (MiB|GiB)", ready_line(settings, 1.0)
    )
    on_gpu = dataclasses.replace(settings, device=torch.device("cuda"))
    assert "; resident memory (host) " in ready_line(on_gpu, 1.0)


def test_the_time_to_ready_counts_from_the_process_start():
    code = (
        "import time; from aioserve.server.serve import seconds_since_start; "
        "time.sleep(0.5); print(seconds_since_start(time.monotonic()))"
    )
    started = time.monotonic()
    printed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    elapsed = time.monotonic() - started
    # The import and the sleep happened after the start: more than the sleep, less than
    # the whole run (the process start time has a clock tick's resolution).
    assert 0.5 < float(printed) <= elapsed + 0.02


def test_without_proc_the_time_counts_from_run_serve(monkeypatch: pytest.MonkeyPatch):
    def no_proc(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(serve.os, "sysconf", no_proc)
    assert 9.9 < seconds_since_start(time.monotonic() - 10) < 11
