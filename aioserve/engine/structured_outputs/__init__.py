"""Structured outputs: constraints on what a request may generate, enforced token by token.

`params` holds the request's constraint (vLLM's StructuredOutputsParams), `compiler`
compiles and caches constraints and picks the backend, `matchers` holds two backends
(outlines, guidance) and the per-sequence matcher the engine advances, `xgrammar_backend`
the third, `structural_tags` reads structural tags and `json_schemas` JSON schemas for
the compiler. Only `params` is imported here: the backends load with the first
constraint compiled.
"""

from aioserve.engine.structured_outputs.params import (
    GuidedDecodingParams,
    StructuredOutputsParams,
)

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
