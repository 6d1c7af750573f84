"""The tokens that delimit a thought, for requests' thinking budgets: vLLM 0.32's
ReasoningConfig, resolved once the tokenizer is loaded.

Reasoning is configured by --reasoning-parser, --reasoning-config, or both (the parser
named on the command line wins over the JSON's `reasoning_parser`). The start and forced
end strings are the JSON's, else the parser's markers (vLLM's reasoning_start_str and
reasoning_end_str: engine/reasoning_parsers.py); a thought ends naturally at the
parser's end marker, or without a parser at the forced end string. Each is tokenized
without special tokens, as vLLM does.
"""

from __future__ import annotations

import logging
from typing import Any

from aioserve.config.engine import DecodingConfig
from aioserve.engine.reasoning_parsers import budget_markers
from aioserve.runner.thinking_budget import ThinkingMarkers

logger = logging.getLogger(__name__)


def thinking_markers(decoding: DecodingConfig, tokenizer: Any) -> ThinkingMarkers | None:
    """The thought markers as token ids; None when reasoning is not configured, or is but
    names no markers (thinking budgets are then refused, as vLLM refuses them)."""
    settings = decoding.reasoning_config
    parser = decoding.reasoning_parser or settings.get("reasoning_parser", "")
    if not parser and not settings:
        return None
    parser_start, parser_end = budget_markers(parser)
    start = settings.get("reasoning_start_str") or parser_start
    end = settings.get("reasoning_end_str") or parser_end
    natural_end = parser_end or end
    if not start or not end:
        logger.warning(
            "--reasoning-config names no reasoning_start_str and reasoning_end_str, and no "
            "reasoning parser gives them: requests' thinking_token_budget will be refused"
        )
        return None
    if tokenizer is None:
        logger.warning(
            "thinking budgets need the tokenizer to find the reasoning markers' tokens, which "
            "is not loaded (--skip-tokenizer-init): requests' thinking_token_budget will be "
            "refused"
        )
        return None
    ids = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (start, end)]
    ids.append(tuple(tokenizer.encode(natural_end, add_special_tokens=False)))
    if not all(ids):
        raise ValueError(
            f"--reasoning-config: the reasoning markers {start!r} and {end!r} do not tokenize "
            "to any token of this model's vocabulary"
        )
    return ThinkingMarkers(*ids)
