"""What a pooling request asks for, its checks against the model, and its vector's last touches.

A pooling request (an embedding) runs through the same scheduler as a generation: its
prompt is one prefill, and the step that runs it returns the pooled hidden states (the
runner pools them as the model's `PoolerConfig` says) instead of a sampled token. Two
things are per request and are applied here, on the host, to the pooled vector:
`dimensions` (a matryoshka model's vector cut to its first n values) and `use_activation`
(L2 normalization; None takes the model's default), in vLLM's order: cut, then normalize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams
from aioserve.models.classifier_activation import activate

if TYPE_CHECKING:
    from aioserve.engine.settings import EngineSettings
    from aioserve.models.pooler import PoolerConfig


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None
    """Keep the first n values of the vector (matryoshka models only); None: all."""
    task: str | None = None
    """"embed" (an embedding model's vector) or "classify" (a sequence classifier's
    scores); None: the model's."""
    use_activation: bool | None = None
    """The task's activation: for embed L2 normalization (vLLM 0.32's name; it replaced
    `normalize`), for classify the model's (sigmoid, softmax); None: as the pooler says."""


def prefill_only_params() -> SamplingParams:
    """The sampling parameters a pooling request carries through the engine: it samples
    nothing, and its one output is its last."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def check_pooling_request(
    settings: EngineSettings,
    vocab_size: int,
    prompt_ids: list[int],
    params: PoolingParams,
    *,
    cut_at_limit: bool = False,
) -> None:
    """Raise InvalidRequest, with vLLM's messages, for a pooling request the engine refuses.

    Unlike a generation, a pooling prompt may fill the whole context: no token follows it.
    `cut_at_limit`: the prompt's text was tokenized no further than one token past the
    context, so a prompt that long had at least that many tokens (vLLM's wording).
    """
    max_model_len, hidden_size = settings.max_model_len, settings.pooled_size
    matryoshka_dimensions = settings.matryoshka_dimensions
    assert settings.pooler is not None
    if params.task not in (None, settings.pooler.task):
        raise InvalidRequest(
            f"this model's pooling task is {settings.pooler.task!r}, not {params.task!r}",
            "task",
            params.task,
        )
    if not prompt_ids:
        raise InvalidRequest("the prompt cannot be empty", "prompt", "[]")
    if len(prompt_ids) > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {'at least ' if cut_at_limit else ''}{len(prompt_ids)} input "
            "tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            len(prompt_ids),
        )
    for token_id in prompt_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"Token id {token_id} is out of vocabulary", "prompt", token_id)
    dimensions = params.dimensions
    if dimensions is None:
        return
    name = repr(settings.served_model_names[0])
    if matryoshka_dimensions is None:
        raise InvalidRequest(
            f"Model {name} does not support Matryoshka embeddings; dimensions must be unset "
            f"(received dimensions={dimensions}).",
            "dimensions",
            dimensions,
        )
    if not 1 <= dimensions <= hidden_size:
        raise InvalidRequest(
            f"Model {name} only supports dimensions in range [1, {hidden_size}], got {dimensions}.",
            "dimensions",
            dimensions,
        )
    if matryoshka_dimensions and dimensions not in matryoshka_dimensions:
        raise InvalidRequest(
            f"Model {name} only supports Matryoshka dimensions {list(matryoshka_dimensions)}, "
            f"got {dimensions}.",
            "dimensions",
            dimensions,
        )


def finish_vector(
    pooled: torch.Tensor, params: PoolingParams, pooler: PoolerConfig
) -> torch.Tensor:
    """The request's vector from the runner's pooled one (float32, 1-D). A classifier's
    logits go through its activation unless `use_activation` (else the pooler) says not to;
    an embedding is cut to the request's `dimensions` (else the pooler's), then normalized
    unless `use_activation` (else the pooler) says not to."""
    use_activation = pooler.normalize if params.use_activation is None else params.use_activation
    if pooler.task == "classify":
        return activate(pooled, pooler.activation) if use_activation else pooled
    dimensions = params.dimensions if params.dimensions is not None else pooler.dimensions
    if dimensions is not None:
        pooled = pooled[:dimensions]
    if use_activation:
        pooled = F.normalize(pooled, p=2.0, dim=-1)
    return pooled


def token_types_of(prompt: object, num_tokens: int, type_vocab_size: int) -> list[int] | None:
    """A prompt dict's "token_type_ids" (a BERT pair's segments), checked: one per token,
    each a type the model has; None when it has none."""
    types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
    if types is None:
        return None
    types = [int(t) for t in types]
    if len(types) != num_tokens:
        raise InvalidRequest(
            f"token_type_ids has {len(types)} entries for {num_tokens} prompt tokens",
            "token_type_ids",
            len(types),
        )
    outside = [t for t in types if not 0 <= t < type_vocab_size]
    if outside:
        raise InvalidRequest(
            f"token type {outside[0]} is outside the model's {type_vocab_size} types",
            "token_type_ids",
            outside[0],
        )
    first_one = types.index(1) if 1 in types else len(types)
    if any(types[:first_one]) or not all(types[first_one:]):
        # vLLM carries a pair's types as where its second text starts (compress_token_type_ids)
        raise InvalidRequest(
            "token_type_ids must be zeros then ones (a text pair's two segments)",
            "token_type_ids",
            str(types),
        )
    return types
