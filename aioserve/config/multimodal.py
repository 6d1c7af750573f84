"""vLLM's multimodal arguments that aioserve takes: --limit-mm-per-prompt and
--allowed-local-media-path.

--limit-mm-per-prompt is vLLM 0.32's JSON object of modality -> count, a count also
written {"count": n} (vLLM's dummy options, whose other keys size its start-up memory
profiling, which aioserve does not run: those are refused by name). A modality it does not
name takes vLLM's 999. --allowed-local-media-path is a folder from which chat requests may
read `file://` images; empty (the default) lets them read none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aioserve.config.values import json_object

DEFAULT_MM_LIMIT = 999
MODALITIES = ("image", "video", "audio")


def mm_limits(value: Any) -> dict[str, int]:
    """--limit-mm-per-prompt: modality -> most items a prompt may carry."""
    limits = {}
    for modality, limit in json_object(value).items():
        if modality not in MODALITIES:
            raise ValueError(f"{modality!r} is not a modality (it takes {', '.join(MODALITIES)})")
        if isinstance(limit, dict):
            extra = sorted(set(limit) - {"count"})
            if extra:
                raise ValueError(
                    f"{modality}: key {extra[0]!r} (a size for vLLM's memory profiling) is "
                    "not supported by aioserve; give the count alone"
                )
            limit = limit.get("count", DEFAULT_MM_LIMIT)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(
                f"{modality}: the count must be an integer of at least 0, got {limit!r}"
            )
        limits[modality] = limit
    return limits


def media_folder(value: Any) -> str:
    """--allowed-local-media-path: an existing folder, kept as its resolved path."""
    if value in ("", None):
        return ""
    folder = Path(str(value)).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{value!r} is not a folder")
    return str(folder.resolve())
