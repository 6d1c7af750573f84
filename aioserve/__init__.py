"""aioserve: an LLM inference server with vLLM's surface, on one event loop and Triton kernels.

`from aioserve import LLM, SamplingParams` (`LoRARequest` for adapters, `PoolingParams` for
embedding models, `BeamSearchParams` for `LLM.beam_search`) gives
the offline API; `python -m aioserve`
the command line. Heavy modules (torch, transformers) load on first use, so the command
line starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "aioserve.engine.llm",
    "LoRARequest": "aioserve.engine.lora_requests",
    "AsyncEngine": "aioserve.engine.async_engine",
    "SamplingParams": "aioserve.engine.sampling_params",
    "BeamSearchParams": "aioserve.engine.beam_search",
    "RequestOutputKind": "aioserve.engine.sampling_params",
    "RequestOutput": "aioserve.engine.outputs",
    "CompletionOutput": "aioserve.engine.outputs",
    "Logprob": "aioserve.engine.outputs",
    "PoolingParams": "aioserve.engine.pooling_params",
    "PoolingRequestOutput": "aioserve.engine.outputs",
}

__all__ = [
    "__version__",
    "AsyncEngine",
    "BeamSearchParams",
    "CompletionOutput",
    "LLM",
    "Logprob",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
]

if TYPE_CHECKING:
    from aioserve.engine.async_engine import AsyncEngine
    from aioserve.engine.beam_search import BeamSearchParams
    from aioserve.engine.llm import LLM
    from aioserve.engine.lora_requests import LoRARequest
    from aioserve.engine.outputs import (
        CompletionOutput,
        Logprob,
        PoolingRequestOutput,
        RequestOutput,
    )
    from aioserve.engine.pooling_params import PoolingParams
    from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'aioserve' has no attribute {name!r}")
