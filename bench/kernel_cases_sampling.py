"""The sampler's cases of bench/kernel_bandwidth.py (bench/kernel_cases.py says what a case
is): the whole Triton sampler greedy and with top-k/top-p, logit bias with the penalties,
and the logprobs, each on float32 logits of a few rows as the engine hands them over.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from aioserve.kernels.sampling import make_sampling_batch
from aioserve.kernels.sampling.logprobs import (
    compute_logprobs_reference,
    compute_logprobs_triton,
)
from aioserve.kernels.sampling.masks import apply_sampling_masks_reference
from aioserve.kernels.sampling.penalties import (
    apply_bias_and_penalties_reference,
    apply_bias_and_penalties_triton,
)
from aioserve.kernels.sampling.sampler import sample_reference, sample_triton
from bench.kernel_case_types import Case, ModelShape, Random

# The random sampling case: least share of rows where the Triton kernels draw the
# reference's token. A GPU's exp differs from torch's in the last bits, which can flip
# a near-tie (aioserve/kernels/sampling/__init__.py), so not every row must agree.
_MIN_DRAW_AGREEMENT = 0.95
_NUM_LOGPROBS = 5

# The minimum bytes of each kernel (B sampled rows, V vocabulary).
FORMULAS = {
    "sample greedy": "float32 logits read + token ids written: 4·B·V + 8·B",
    "sample top-k/top-p": "as sample greedy (mask and draw passes are extra traffic)",
    "bias+penalties": "float32 logits, int32 counts, bool prompt mask read + float32 out "
    "written: 13·B·V (+ the bias pairs)",
    "logprobs": f"float32 logits read + ids + n={_NUM_LOGPROBS} top (id, logprob) written: "
    "4·B·V + 8·B + 12·B + 12·n·B",
}


def _sampler_case(
    kernel: str,
    model: ModelShape,
    rows: int,
    traffic: int,
    run: Callable[[], object],
    check: Callable[[], str | None],
) -> Case:
    """A sampler kernel's case: float32 logits of `rows` rows, memory-bound (no FLOPs)."""
    return Case(kernel, model.name, _rows_label(rows), torch.float32, traffic, 0, run, check)


def _rows_label(rows: int) -> str:
    return "1 row" if rows == 1 else f"{rows} rows"


def _logits(rand: Random, rows: int, vocab: int) -> Tensor:
    # float32, as the model's compute_logits hands them to the sampler.
    return rand.normal(rows, vocab, scale=3.0)


def sample_greedy_case(rand: Random, model: ModelShape, rows: int) -> Case:
    """The whole Triton sampler, every row greedy: one argmax pass."""
    logits = _logits(rand, rows, model.vocab)
    batch = make_sampling_batch(rows, device=rand.device, temperature=0.0)
    traffic = 4 * rows * model.vocab + 8 * rows  # 4·B·V + 8·B

    def check() -> str | None:
        tokens = sample_triton(logits, batch).token_ids
        if torch.equal(tokens, sample_reference(logits, batch).token_ids):
            return None
        return "greedy tokens differ from the reference's argmax"

    return _sampler_case(
        "sample greedy", model, rows, traffic, lambda: sample_triton(logits, batch), check
    )


def sample_random_case(rand: Random, model: ModelShape, rows: int) -> Case:
    """The whole Triton sampler with temperature, top-k and top-p: masks, then the draw."""
    logits = _logits(rand, rows, model.vocab)
    settings = dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.0)
    seeds = rand.integers(0, 2**62, rows).tolist()
    batch = make_sampling_batch(rows, device=rand.device, seeds=seeds, steps=7, **settings)
    traffic = 4 * rows * model.vocab + 8 * rows  # 4·B·V + 8·B

    def check() -> str | None:
        tokens = sample_triton(logits, batch).token_ids
        expected = sample_reference(logits, batch).token_ids
        masks = (batch.temperature, batch.top_k, batch.top_p, batch.min_p)
        kept = apply_sampling_masks_reference(logits, *masks) > float("-inf")
        if not bool(kept.gather(1, tokens[:, None]).all()):
            return "a drawn token is one that top-k/top-p drop"
        agreement = (tokens == expected).float().mean().item()
        if agreement < _MIN_DRAW_AGREEMENT:
            return f"only {agreement:.0%} of rows drew the reference's token"
        return None

    return _sampler_case(
        "sample top-k/top-p", model, rows, traffic, lambda: sample_triton(logits, batch), check
    )


def bias_and_penalties_case(rand: Random, model: ModelShape, rows: int) -> Case:
    """Logit bias, then repetition, frequency and presence penalties, on every row."""
    vocab = model.vocab
    logits = _logits(rand, rows, vocab)
    bias_ids = rand.integers(0, vocab, rows, 2).tolist()
    batch = make_sampling_batch(
        rows,
        device=rand.device,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        output_token_counts=rand.integers(0, 3, rows, vocab, dtype=torch.int32),
        prompt_token_mask=rand.uniform(rows, vocab) < 0.01,
        logit_bias=[{ids[0]: float("-inf"), ids[1]: 5.0} for ids in bias_ids],
    )
    traffic = 13 * rows * vocab  # (4 + 4 + 1) read + 4 written per (row, token)

    def check() -> str | None:
        out = apply_bias_and_penalties_triton(logits, batch)
        if torch.equal(out, apply_bias_and_penalties_reference(logits, batch)):
            return None
        return "penalized logits differ from the reference's (they must be exact)"

    return _sampler_case(
        "bias+penalties",
        model,
        rows,
        traffic,
        lambda: apply_bias_and_penalties_triton(logits, batch),
        check,
    )


def logprobs_case(rand: Random, model: ModelShape, rows: int) -> Case:
    """Raw logprobs of given tokens, their rank and the top n."""
    logits = _logits(rand, rows, model.vocab)
    token_ids = rand.integers(0, model.vocab, rows)
    n = _NUM_LOGPROBS
    traffic = 4 * rows * model.vocab + 8 * rows + 12 * rows + 12 * n * rows

    def check() -> str | None:
        out = compute_logprobs_triton(logits, token_ids, n)
        expected = compute_logprobs_reference(logits, token_ids, n)
        if not torch.equal(out.top_token_ids, expected.top_token_ids):
            return "top token ids differ"
        if not torch.equal(out.sampled_rank, expected.sampled_rank):
            return "sampled ranks differ"
        for name in ("top_logprobs", "sampled_logprob"):
            error = (getattr(out, name) - getattr(expected, name)).abs().max().item()
            if not error <= 1e-4:
                return f"{name} off by {error:.1e} (> 1e-4)"
        return None

    return _sampler_case(
        "logprobs",
        model,
        rows,
        traffic,
        lambda: compute_logprobs_triton(logits, token_ids, n),
        check,
    )
