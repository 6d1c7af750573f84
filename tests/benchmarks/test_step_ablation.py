"""bench/step_ablation.py, run as a user would on the default model at small sizes: each
part taken away from the one-stream step, alternated with the full step in one process."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.child_process import die_with_parent

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "step_ablation.py"

# A time per token is the difference of two requests' times (step_ablation.per_token): on a
# loaded host, at these small sizes, it can come out negative, so the columns are signed.
ROW = re.compile(
    r"^(?P<part>[\w-]+) +(?P<full>-?[\d.]+) +(?P<without>-?[\d.]+) +(?P<diff>[+-][\d.]+) ± "
    r"+[\d.]+ +(?P<faster>\d+)/(?P<pairs>\d+)$",
    re.M,
)


def test_every_part_is_timed_with_and_without(smollm2_gguf):
    argv = [sys.executable, str(SCRIPT), "--model", str(smollm2_gguf), "--pairs", "2"]
    argv += ["--input-len", "16", "--output-len", "8"]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=600, preexec_fn=die_with_parent
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {m["part"]: m for m in ROW.finditer(run.stdout)}
    expected = ["attention", "kv-write", "bags", "int4", "head", "one-row-graph"]
    assert list(rows) == expected, run.stdout
    for row in rows.values():
        assert row["pairs"] == "2", run.stdout
        difference = float(row["without"]) - float(row["full"])
        assert float(row["diff"]) == pytest.approx(difference, abs=0.02), run.stdout


def _load_script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # as when run: bench/ first on the path
    spec = importlib.util.spec_from_file_location("step_ablation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("part", "owner", "name"),
    [
        ("attention", "aioserve.models.paged_attention_op", "paged_attention"),
        ("attention", "aioserve.models.paged_attention_op", "write_kv_cache"),
        ("kv-write", "aioserve.models.paged_attention_op", "write_kv_cache"),
        ("bags", "aioserve.kernels.decode_in_pool", "_weighted_sums"),
        ("int4", "aioserve.models.linear", "int4_linear"),
    ],
)
def test_a_part_is_replaced_where_the_step_looks_it_up_and_put_back(part, owner, name, monkeypatch):
    module = importlib.import_module(owner)
    original = getattr(module, name)
    with _load_script(monkeypatch).PARTS[part]():
        assert getattr(module, name) is not original
    assert getattr(module, name) is original


def test_without_the_one_row_graph_no_step_is_served_by_it(monkeypatch):
    from aioserve.runner.one_row_step import OneRowStep

    original = OneRowStep.serves
    with _load_script(monkeypatch).PARTS["one-row-graph"]():
        assert OneRowStep.serves(None, None, 1) is False
    assert OneRowStep.serves is original


def test_without_int4_the_products_are_zeros_of_the_output_shape(monkeypatch):
    from aioserve.kernels.gguf_linear_reference import pack_int4
    from aioserve.models import linear

    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    packed, scales = pack_int4(codes, torch.rand(32, 2), torch.rand(32, 2))
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    with _load_script(monkeypatch).PARTS["int4"]():
        out = linear.int4_linear(x, packed, scales)
    assert out.shape == (1, 32) and not out.any()
    assert linear.int4_linear(x, packed, scales).any()


def test_an_unknown_part_is_refused_by_name():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--parts", "attention,lm_head"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=die_with_parent,
    )
    assert run.returncode == 2
    assert "unknown parts ['lm_head']" in run.stderr
