"""The tiny model's tokenizer (tests/conftest.py's `tiny_model`), for the benchmarks' datasets,
and vLLM's own answers on the same inputs when a local vLLM is there to ask."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# A local vLLM install to compare with; tests that use it still pass without one.
VLLM_PYTHON = Path(
    os.environ.get(
        "AIOSERVE_VLLM_PYTHON",
        Path.home() / ".cache/aioserve-peers/vllm-venv/bin/python",
    )
)


def run_vllm_reference(spec: dict, tmp_dir: Path) -> dict | None:
    """vllm_reference.py's answers for `spec` from vLLM's python, or None without vLLM."""
    if not VLLM_PYTHON.exists():
        return None
    spec_path = tmp_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    script = Path(__file__).with_name("vllm_reference.py")
    run = subprocess.run(
        [str(VLLM_PYTHON), str(script), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_dir,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("VLLM-REFERENCE "))
    return json.loads(line.removeprefix("VLLM-REFERENCE "))
