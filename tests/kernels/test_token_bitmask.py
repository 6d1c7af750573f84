"""apply_token_bitmask: the torch reference against a plain loop over the bits, the Triton
kernel against the reference; vocabularies that are and are not whole words, rows left
alone, all-allowed and all-banned masks."""

from __future__ import annotations

import pytest
import torch

from aioserve.kernels.dispatch import kernel_backend, set_kernel_backend
from aioserve.kernels.sampling import make_sampling_batch, sample
from aioserve.kernels.sampling.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_reference,
)


def random_bitmask(num_masks: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    words = -(-vocab_size // 32)
    bits = torch.randint(0, 2**32, (num_masks, words), generator=generator, dtype=torch.int64)
    return (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)  # the same bits, signed


def expected(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for mask_row, row in enumerate(rows.tolist()):
        for token in range(logits.shape[1]):
            word = int(bitmask[mask_row, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 2100])
def test_reference_bans_exactly_the_unset_bits(device, vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(5, vocab_size, generator=generator).to(device)
    bitmask = random_bitmask(3, vocab_size, generator).to(device)
    bitmask[1] = -1  # every token allowed
    rows = torch.tensor([4, 0, 2], device=device)
    want = expected(logits.cpu(), bitmask.cpu(), rows.cpu())
    apply_token_bitmask_reference(logits, bitmask, rows)
    torch.testing.assert_close(logits.cpu(), want, atol=0, rtol=0)
    assert torch.isfinite(logits[[1, 3]]).all()  # rows without a mask are left alone


@pytest.mark.parametrize("vocab_size", [31, 33, 2100])
def test_triton_kernel_matches_the_reference(device, triton_backend, vocab_size):
    generator = torch.Generator().manual_seed(7 + vocab_size)
    logits = torch.randn(6, vocab_size, generator=generator).to(device)
    bitmask = random_bitmask(4, vocab_size, generator).to(device)
    bitmask[2] = 0  # every token banned
    rows = torch.tensor([5, 1, 3, 0], device=device)
    reference = logits.clone()
    apply_token_bitmask_reference(reference, bitmask, rows)
    apply_token_bitmask(logits, bitmask, rows)
    torch.testing.assert_close(logits, reference, atol=0, rtol=0)
    assert torch.isneginf(logits[3]).all()


def test_no_masks_change_nothing(device, triton_backend):
    logits = torch.randn(2, 40, device=device)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros((0, 2), dtype=torch.int32, device=device),
                        torch.zeros(0, dtype=torch.int64, device=device))  # fmt: skip
    torch.testing.assert_close(logits, before, atol=0, rtol=0)


def test_a_bitmask_too_short_for_the_vocabulary_is_refused(device):
    logits = torch.randn(1, 40, device=device)
    with pytest.raises(ValueError, match="covers 32 tokens, not the vocabulary's 40"):
        apply_token_bitmask(
            logits, torch.zeros((1, 1), dtype=torch.int32, device=device), torch.zeros(1).long()
        )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_draws_only_allowed_tokens(device, temperature):
    vocab_size, num_rows = 200, 4
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(device)
    allowed = [7, 64, 65, 199]
    words = torch.zeros(1, -(-vocab_size // 32), dtype=torch.int64)
    for token in allowed:
        words[0, token // 32] |= 1 << (token % 32)
    bitmask = (words - (words >= 2**31).long() * 2**32).to(torch.int32).to(device)
    batch = make_sampling_batch(
        num_rows, device=device, temperature=temperature, seeds=range(num_rows),
        steps=range(num_rows), num_logprobs=2, token_bitmask=bitmask,
        bitmask_rows=torch.tensor([2], device=device),
    )  # fmt: skip
    before = logits.clone()
    drawn = {}
    previous = kernel_backend()
    for backend in ("reference", "triton"):
        set_kernel_backend(backend)
        try:
            drawn[backend] = sample(logits, batch)
        finally:
            set_kernel_backend(previous)
    torch.testing.assert_close(logits, before, atol=0, rtol=0)  # the caller's logits untouched
    assert drawn["reference"].token_ids.tolist() == drawn["triton"].token_ids.tolist()
    assert drawn["reference"].token_ids[2].item() in allowed
    if temperature == 0.0:  # the unconstrained rows keep their argmax
        assert (
            drawn["reference"].token_ids[[0, 1, 3]].tolist()
            == logits[[0, 1, 3]].argmax(-1).tolist()
        )
    # Raw logprobs are the unconstrained distribution's, as in vLLM.
    raw = torch.log_softmax(logits[2].float(), -1)[drawn["reference"].token_ids[2]]
    assert drawn["reference"].logprobs.sampled_logprob[2].item() == pytest.approx(
        raw.item(), abs=1e-5
    )
