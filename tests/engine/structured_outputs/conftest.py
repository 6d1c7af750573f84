"""The structured-output tests' tokenizer (SmolLM2's) and a compiler with the default
settings (tests/conftest.py); a module that needs other settings defines its own
`compiler`."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(smollm2_compiler):
    return smollm2_compiler
