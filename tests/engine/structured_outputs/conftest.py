"""The structured-output tests' tokenizer (SmolLM2's) and a compiler with the default
settings; a module that needs other settings defines its own `compiler`."""

from __future__ import annotations

import pytest

from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from tests.engine.structured_outputs.walks import VOCAB


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer) -> StructuredOutputCompiler:
    return StructuredOutputCompiler(tokenizer, VOCAB, StructuredOutputsConfig())
