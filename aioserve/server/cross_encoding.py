"""A cross-encoder's text pairs: how /score and /rerank tokenize a (query, document) pair.

As vLLM 0.32 scores with a sequence classifier of one label (entrypoints/pooling/scoring/
io_processor.py, CrossEncoderIOProcessor; the answers recorded in tests/server/
vllm_samples 100-149): each pair is one prompt, the tokenizer's pair encoding
`tokenizer(query, document)` ([CLS] query [SEP] document [SEP] for BERT, with token type
ids 0 for the query's part and 1 for the document's, which the model is given), and its
score is the model's one logit through its activation (the engine's).

- `max_tokens_per_query` / `max_tokens_per_doc` first cut each text on its own to that
  many tokens at a character boundary (`truncate_text`); with a document budget the pair
  is then encoded with `truncation="only_second"` to at most query + budget + the pair's
  special tokens (min'ed with the request's own cut), as vLLM does.
- `truncate_prompt_tokens` N without `truncation_side`: the tokenizer cuts the pair
  (`truncation=True, max_length=N`: longest_first, special tokens kept); with a side, the
  pair's tokens and token types are sliced alike (pooling_requests.checked_prompts).
- Without either, the pair is whole; one past the context is refused with its real
  length (vLLM tokenizes to max_model_len + 1 and says "at least 513").
- An empty document is no pair: the tokenizer encodes the query alone.
- A tokenizer without token types (RoBERTa's, XLM-R's: one segment, <s> a </s></s> b
  </s>) gives none, and none are sent (vllm_samples 161-163).
- A pair the tokenizer cannot cut as asked ("only_second" with the query alone past the
  cut) is a 500 with the tokenizer's message, as vLLM answers it (sample 164).
"""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.server.errors import APIError
from aioserve.server.pooling_requests import Prompt


def truncate_text(tokenizer: Any, text: str, max_tokens: int) -> str:
    """`text` cut to at most `max_tokens` tokens (special tokens not counted) at a character
    boundary, as vLLM's truncate_text_to_tokens cuts it (by the tokenizer's offsets)."""
    if max_tokens <= 0:
        return ""
    while text:
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if len(encoding["input_ids"]) <= max_tokens:
            break
        end = min(offsets[max_tokens - 1][1], offsets[max_tokens][0])
        text = text[: min(end, len(text) - 1)]
    return text


def num_pair_special_tokens(tokenizer: Any) -> int:
    """How many special tokens a pair encoding adds (3 for BERT, 4 for RoBERTa)."""
    method = getattr(tokenizer, "num_special_tokens_to_add", None)
    if method is not None:
        try:
            return method(pair=True)
        except TypeError:
            pass
    return len(tokenizer("", text_pair="", add_special_tokens=True)["input_ids"])


def encode_pair(
    tokenizer: Any,
    query: str,
    document: str,
    *,
    max_length: int | None = None,
    max_query_tokens: int = 0,
    max_doc_tokens: int = 0,
) -> Prompt:
    """One pair's prompt: its token ids, and token types when the tokenizer gives them.

    `max_length`: the tokenizer's cut of the whole pair (truncate_prompt_tokens without a
    side), None for none; the budgets: 0 for none."""
    if max_query_tokens > 0:
        query = truncate_text(tokenizer, query, max_query_tokens)
    kwargs: dict[str, Any] = {"add_special_tokens": True}
    if max_length is not None:
        kwargs.update(truncation=True, max_length=max_length)
    if max_doc_tokens > 0:
        document = truncate_text(tokenizer, document, max_doc_tokens)
        query_tokens = len(tokenizer.encode(query, add_special_tokens=False))
        limit = query_tokens + max_doc_tokens + num_pair_special_tokens(tokenizer)
        kwargs.update(
            truncation="only_second",
            max_length=limit if max_length is None else min(limit, max_length),
        )
    try:
        encoded = tokenizer(text=query, text_pair=document, **kwargs)
    except Exception as error:  # the tokenizer's own refusal, e.g. "only_second" too short
        # vLLM answers it as its unexpected errors: a 500 with the tokenizer's message.
        raise APIError(str(error), HTTPStatus.INTERNAL_SERVER_ERROR) from None
    types = encoded.get("token_type_ids")
    ids = list(encoded["input_ids"])
    return Prompt(None, ids, None if types is None else list(types), cut=max_length is not None)


def encode_pairs(
    tokenizer: Any,
    queries: Sequence[str],
    documents: Sequence[str],
    *,
    max_length: int | None = None,
    max_query_tokens: int = 0,
    max_doc_tokens: int = 0,
) -> list[Prompt]:
    """The prompts of /score's or /rerank's pairs: one query against every document, or
    the i-th against the i-th."""
    if len(queries) == 1:
        queries = list(queries) * len(documents)
    return [
        encode_pair(
            tokenizer,
            query,
            document,
            max_length=max_length,
            max_query_tokens=max_query_tokens,
            max_doc_tokens=max_doc_tokens,
        )
        for query, document in zip(queries, documents, strict=True)
    ]


def pair_score(output: PoolingRequestOutput) -> float:
    """A pair's score: the classifier's one (activated) output, as vLLM's
    ScoringOutput.from_base reads it."""
    data = output.data
    if data.numel() != 1:
        raise APIError("pooled_data should be a scalar score", HTTPStatus.INTERNAL_SERVER_ERROR)
    return float(data.reshape(()).item())
