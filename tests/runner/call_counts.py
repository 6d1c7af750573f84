"""Counting a runner part's calls in tests: which path a step took."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def count_calls(
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    counts: Callable[[Any], bool] | None = None,
) -> list[int]:
    """Wraps `owner.name`: the list's one item counts its calls (those that raise too), or
    with `counts` those whose result it accepts."""
    calls = [0]
    original = getattr(owner, name)

    def counted(*args):
        if counts is None:
            calls[0] += 1
            return original(*args)
        result = original(*args)
        calls[0] += bool(counts(result))
        return result

    monkeypatch.setattr(owner, name, counted)
    return calls
