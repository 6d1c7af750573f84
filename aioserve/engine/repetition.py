"""vLLM 0.32's `repetition_detection`: a request ends early, finish_reason "repetition",
when its output ends with a short token pattern repeated back to back.

With `max_pattern_size` M, `min_pattern_size` m (0 means 1) and `min_count` c, the output
stops once, for some length L from m to M, its last c * L tokens are one L-token pattern
written c times (checked after each token, once min_tokens are out; vLLM's check_stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RepetitionDetectionParams:
    """vLLM's fields and checks; all 0 (the defaults) turns detection off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"repetition_detection.{name} must be an integer, got {value!r}")
        if (
            self.max_pattern_size < 0
            or self.min_pattern_size < 0
            or self.min_pattern_size > self.max_pattern_size
        ):
            raise ValueError(
                "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                "max_pattern_size. Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "min_count must be >= 2 to detect repetitive patterns in engine output. If you "
                "do not wish to detect repetitive patterns, set max_pattern_size to 0."
            )

    @classmethod
    def of(cls, value: Any) -> RepetitionDetectionParams | None:
        """From itself, a mapping of its fields (a JSON body's), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"repetition_detection must be an object, got {value!r}")
        unknown = sorted(set(value) - {"max_pattern_size", "min_pattern_size", "min_count"})
        if unknown:
            raise ValueError(f"repetition_detection has unknown field(s): {', '.join(unknown)}")
        return cls(**value)


def ends_in_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether `token_ids` end with a pattern of params' lengths repeated min_count times."""
    count = params.min_count
    if params.max_pattern_size <= 0 or count < 2:
        return False
    total = len(token_ids)
    for length in range(max(1, params.min_pattern_size), params.max_pattern_size + 1):
        span = length * count
        if span > total:
            return False
        tail = token_ids[total - span :]
        pattern = tail[-length:]
        if all(tail[i : i + length] == pattern for i in range(0, span - length, length)):
            return True
    return False
