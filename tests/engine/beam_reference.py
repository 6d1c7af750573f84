"""Beam search written from its definition (vLLM 0.32's, entrypoints/generate/beam_search/),
for tests to hold aioserve's against: at each step every live beam is extended by each of
the 2 * beam_width most likely next tokens (logprobs from the model's logits, as
transformers computes them); an extension ending in EOS is finished, the others ranked by
cumulative logprob and the best beam_width live on; at the end finished and live beams are
sorted by cumulative logprob / length ** length_penalty (the length counts the prompt and
not a final EOS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Beam:
    tokens: list[int]  # the prompt's, then the generated ones (a final EOS included)
    cum_logprob: float
    finished: bool  # ended by EOS


def reference_beam_search(
    next_logprobs: Callable[[tuple[int, ...]], torch.Tensor],
    prompt: list[int],
    beam_width: int,
    max_tokens: int,
    eos: int,
    length_penalty: float = 1.0,
    ignore_eos: bool = False,
) -> list[Beam]:
    """The best `beam_width` beams, best first; `next_logprobs(tokens)` is the log-softmax
    of the model's next-token logits after `tokens`."""
    live = [Beam(list(prompt), 0.0, False)]
    finished: list[Beam] = []
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for beam in live:
            top = torch.topk(next_logprobs(tuple(beam.tokens)), 2 * beam_width)
            for value, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                extended = Beam(beam.tokens + [token], beam.cum_logprob + value, False)
                if token == eos and not ignore_eos:
                    extended.finished = True
                    finished.append(extended)
                else:
                    candidates.append(extended)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        live = candidates[:beam_width]

    def score(beam: Beam) -> float:
        length = len(beam.tokens) - (1 if beam.tokens[-1] == eos else 0)
        return beam.cum_logprob / max(length, 1) ** length_penalty

    return sorted(finished + live, key=score, reverse=True)[:beam_width]


def transformers_logprobs(model) -> Callable[[tuple[int, ...]], torch.Tensor]:
    """`next_logprobs` of a transformers causal LM (float32 logits, float64 log-softmax),
    cached per token sequence."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def next_logprobs(tokens: tuple[int, ...]) -> torch.Tensor:
        if tokens not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            cache[tokens] = torch.log_softmax(logits.double(), dim=-1)
        return cache[tokens]

    return next_logprobs
