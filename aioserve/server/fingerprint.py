"""The `system_fingerprint` of completions and chat completions (--fingerprint-mode).

vLLM 0.32 writes `vllm-<version>[-tp<n>][-pp<n>][-dp<n>][-ep]-<hash8>` ("full"), the same
without the parallelism parts ("hash"), `--fingerprint-value` ("custom") or null ("none"),
where hash8 is the first 8 hex digits of a hash of the configuration that shapes the
computation. aioserve's "full" and "hash" are `aioserve-<version>-<hash8>`: it runs no
tensor, pipeline, data or expert parallelism, so "full" has no parallelism parts to add,
and the hash is over aioserve's resolved engine settings (what decides the model's
outputs: the weights and their form, dtypes, lengths, block size, speculation, LoRA,
logits processors, the pooler) with the version. It is computed once per server and is
the same for every server started with the same model and settings.

Where it appears is vLLM's: every non-streamed response (null with "none"); in a stream,
the chunk that finishes a choice when no usage chunk follows, else the usage chunk; a
stream leaves the key out when the fingerprint is null.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from aioserve import __version__

if TYPE_CHECKING:
    from aioserve.config.frontend import FrontendConfig
    from aioserve.engine.settings import EngineSettings


def settings_hash(settings: EngineSettings) -> str:
    """8 hex digits identifying the engine settings that decide the model's outputs."""
    report = settings.load_report
    factors = [
        __version__,
        settings.model_name,
        str(settings.dtype),
        settings.device.type,
        settings.max_model_len,
        settings.block_size,
        settings.max_logprobs,
        settings.enable_prefix_caching,
        settings.enable_prompt_embeds,
        sorted(settings.eos_token_ids),
        repr(settings.speculation),
        repr(settings.pooler),
        settings.max_loras,
        [f"{c.__module__}.{c.__qualname__}" for c in settings.logits_processor_classes],
    ]
    if report is not None:
        stored_form = (report.load_format, report.stored_types, report.dtype, report.quantization)
        factors += [repr(stored_form), report.kv_cache_dtype]
    return hashlib.sha256(repr(factors).encode()).hexdigest()[:8]


def system_fingerprint(settings: EngineSettings, frontend: FrontendConfig) -> str | None:
    """The fingerprint that --fingerprint-mode (and --fingerprint-value) ask for."""
    mode = frontend.fingerprint_mode
    if mode == "none":
        return None
    if mode == "custom":
        return frontend.fingerprint_value
    return f"aioserve-{__version__}-{settings_hash(settings)}"
