"""Token ids back to text for the derender routes (derender_routes.py), as vLLM 0.32's
OnlineDerenderer does it (vllm/renderers/online_derenderer.py).

The text is aioserve's incremental detokenizer's (engine/detokenizer.py): the same sliding
window vLLM decodes with, so the pieces are vLLM's. What a streamed derender carries from
one call to the next is vLLM's `DerenderStreamState`, which a client passes back each
time: the window as token strings (`prev_tokens`, from `prefix_offset`) and how much of it
was read (`read_offset`), converted to token ids and back around each call. As vLLM's, the
window starts in the prompt's last tokens (its last seven, special tokens dropped when they
are skipped, the last five read), or empty without prompt ids; special tokens skipped are
not in it.

Logprobs come from the generate server by token id; each is given its text and bytes as
vLLM's `decode_token_ids` does (the token decoded alone; a SentencePiece leading space
restored), and a token that is part of a UTF-8 character (ends in U+FFFD) is read with up
to four sampled tokens before it (vLLM's `_correct_decoded_token`), carried across calls in
`logprob_context_token_ids`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from aioserve.engine.detokenizer import IncrementalDetokenizer

SEED_TOKENS = 7  # vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET + 2
SEED_READ = 5  # vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET
LOGPROB_CONTEXT = 4  # vLLM's _LOGPROB_CONTEXT_WINDOW
_REPLACEMENT = "\ufffd"


@dataclass
class StreamState:
    """vLLM's DerenderStreamState, field by field, in its order."""

    prev_tokens: list[str] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    role_sent: bool = False
    logprob_context_token_ids: list[int] = field(default_factory=list)
    logprob_text_offset: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_chunk_lens: list[int] = field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        return asdict(self)


def decode_params(
    tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool | None,
    spaces_between_special_tokens: bool | None,
    preserve_special: bool = False,
) -> tuple[bool, bool]:
    """vLLM's `_decode_params`: the request's settings (both true without a request),
    special tokens kept for a parser; a fast tokenizer skipping them spaces them."""
    skip = False if preserve_special else skip_special_tokens is not False
    spaces = spaces_between_special_tokens is not False
    if skip and tokenizer.is_fast:
        spaces = True
    return skip, spaces


def seed_state(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int] | None, skip: bool
) -> StreamState:
    """The state before the first output token: the prompt's last tokens (vLLM's
    `convert_prompt_ids_to_tokens`), or empty without a prompt."""
    if not prompt_token_ids:
        return StreamState()
    tokens = _tokens(tokenizer, list(prompt_token_ids[-SEED_TOKENS:]), skip)
    return StreamState(
        prev_tokens=tokens,
        prefix_offset=max(len(tokens) - SEED_READ, 0),
        read_offset=len(tokens),
    )


def detokenize(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    state: StreamState,
    skip: bool,
    spaces: bool,
) -> tuple[str, StreamState]:
    """The text `token_ids` add after `state`, and the state after them (vLLM's
    `_detokenize_delta`: the window trimmed to what is still read, offsets rebased)."""
    if not token_ids:
        return "", state
    window = [_token_id(tokenizer, token) for token in state.prev_tokens[state.prefix_offset :]]
    detokenizer = IncrementalDetokenizer.resumed(
        tokenizer,
        window,
        state.read_offset - state.prefix_offset,
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
    )
    text = detokenizer.add_tokens(list(token_ids))
    window, read = detokenizer.window_state
    tokens = _tokens(tokenizer, window, skip)
    read_tokens = len(_tokens(tokenizer, window[:read], skip))
    return text, replace(state, prev_tokens=tokens, prefix_offset=0, read_offset=read_tokens)


def _tokens(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip: bool) -> list[str]:
    """Token strings of `token_ids`, "" for an id outside the vocabulary (vLLM's)."""
    tokens = tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=skip)
    return [token or "" for token in tokens]


def _token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of a window's token string; "" (or an unknown string) as an id outside the
    vocabulary, which decodes to nothing, as vLLM's "" does."""
    token_id = _vocab(tokenizer).get(token) if token else None
    return len(tokenizer) if token_id is None else token_id


@functools.cache
def _vocab(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    return tokenizer.get_vocab()


# -- logprobs ---------------------------------------------------------------------------------


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    logprobs: dict[str, Any],
    context_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """vLLM's `_resolve_logprobs`: the generate server's logprobs (by token id) as chat's
    (`{"content": [{token, logprob, bytes, top_logprobs}]}`)."""
    content = logprobs.get("content")
    if content is None:
        return {"content": None}
    context = list(context_token_ids)
    resolved = []
    for entry in content:
        top = entry.get("top_logprobs") or []
        ids = [entry["token_id"], *(t["token_id"] for t in top)]
        (text, text_bytes), *top_texts = _token_texts(tokenizer, ids)
        if text.endswith(_REPLACEMENT):
            text = _corrected(tokenizer, entry["token_id"], context)
            text_bytes = list(text.encode("utf-8"))
        tops = []
        for candidate, (top_text, top_bytes) in zip(top, top_texts, strict=True):
            if top_text.endswith(_REPLACEMENT):
                top_text = _corrected(tokenizer, candidate["token_id"], context)
                top_bytes = list(top_text.encode("utf-8"))
            tops.append({"token": top_text, "logprob": candidate["logprob"], "bytes": top_bytes})
        resolved.append(
            {"token": text, "logprob": entry["logprob"], "bytes": text_bytes, "top_logprobs": tops}
        )
        context.append(entry["token_id"])
    return {"content": resolved}


def completion_logprobs(chat: dict[str, Any], text_offset: int = 0) -> dict[str, Any]:
    """vLLM's `_convert_chat_logprobs_to_completion_logprobs`: chat's logprobs as the
    completions' parallel lists, `text_offset` running on from `text_offset`."""
    offsets: list[int] = []
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float] | None] = []
    for entry in chat["content"] or []:
        offsets.append(text_offset)
        tokens.append(entry["token"])
        token_logprobs.append(entry["logprob"])
        tops = entry["top_logprobs"]
        top_logprobs.append({t["token"]: t["logprob"] for t in tops} if tops else None)
        text_offset += len(entry["token"])
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": top_logprobs,
    }


def context_tail(context_token_ids: Sequence[int], token_ids: Sequence[int]) -> list[int]:
    """The sampled ids the next call's logprobs read before their own (the last four)."""
    return [*context_token_ids, *token_ids][-LOGPROB_CONTEXT:]


def _token_texts(
    tokenizer: PreTrainedTokenizerBase, token_ids: list[int]
) -> list[tuple[str, list[int] | None]]:
    """vLLM's `decode_token_ids`: each id's text alone and its UTF-8 bytes; ("", None) for
    an id with no vocabulary entry."""
    marker = _space_marker(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(token_ids)
    texts: list[tuple[str, list[int] | None]] = []
    for token_id, piece in zip(token_ids, pieces, strict=True):
        if piece is None:
            texts.append(("", None))
            continue
        text = tokenizer.decode([token_id]) or ""
        if marker is not None:
            text = _restore_leading_spaces(piece, text, marker)
        texts.append((text, list(text.encode("utf-8", errors="replace"))))
    return texts


def _corrected(tokenizer: PreTrainedTokenizerBase, token_id: int, context: list[int]) -> str:
    """vLLM's `_correct_decoded_token`: a token that ends inside a UTF-8 character read with
    the fewest sampled tokens before it that complete it ("" when none does)."""
    for num_context in range(1, min(len(context), LOGPROB_CONTEXT) + 1):
        before = context[-num_context:]
        whole = tokenizer.decode([*before, token_id])
        if whole.endswith(_REPLACEMENT):
            continue
        clean_end = len(before)
        for j in range(len(before) - 1, -1, -1):
            if not tokenizer.decode([before[j]]).endswith(_REPLACEMENT):
                break
            clean_end = j
        prefix = tokenizer.decode(before[:clean_end]) if clean_end > 0 else ""
        if whole.startswith(prefix):
            return whole[len(prefix) :]
        common = 0
        for a, b in zip(prefix, whole, strict=False):
            if a != b:
                break
            common += 1
        return whole[common:]
    return ""


@functools.cache
def _space_marker(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The leading-space marker of a Metaspace pre-tokenizer (SentencePiece), which decoding
    a token alone drops (vLLM's `get_leading_space_marker`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    for candidate in [pre, *(pre.get("pretokenizers") or [])]:
        if candidate.get("type") == "Metaspace":
            return candidate.get("replacement", "\u2581")
    return None


def _restore_leading_spaces(piece: str, text: str, marker: str) -> str:
    markers = len(piece) - len(piece.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text
