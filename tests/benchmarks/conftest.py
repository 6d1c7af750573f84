"""The tiny model's tokenizer (tests/conftest.py's `tiny_model`), for the benchmarks' datasets."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)
