"""Our Llama-family models against transformers, over mixed prefill/decode steps.

Each tiny random-weight model runs a schedule that mixes full prompts, prompt chunks
continuing over cached blocks, and decodes in the same flat batch, with the KV cache paged
over shuffled physical blocks. Every row's logits must equal transformers' logits at the
same position of the same sequence (teacher-forced: the whole sequence is known ahead).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny_models import PagedRunner, hf_and_ours, tiny_configs

CONFIGS = tiny_configs()

# Sequences: prompt + tokens fed one by one as decodes.
SEQUENCES = {
    0: list(range(3, 16)) + [40, 41, 42],
    1: [7, 100, 3, 9, 200, 17, 250, 1],
    2: [5, 5, 5, 60, 61, 62, 63, 64, 65, 11],
}
# Steps: (sequence, start, end) slices of SEQUENCES fed in one flat batch.
SCHEDULE = [
    [(0, 0, 13), (1, 0, 4)],
    [(0, 13, 14), (1, 4, 6), (2, 0, 5)],
    [(0, 14, 15), (1, 6, 7), (2, 5, 9)],
    [(2, 9, 10), (0, 15, 16), (1, 7, 8)],
]


def hf_logits(hf) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        return {
            seq: hf(torch.tensor([tokens])).logits[0].float() for seq, tokens in SEQUENCES.items()
        }


def run_schedule(ours, dtype) -> list[tuple[int, int, torch.Tensor]]:
    runner = PagedRunner(ours, dtype=dtype)
    rows = []
    for step in SCHEDULE:
        logits = runner.step([(seq, SEQUENCES[seq][start:end]) for seq, start, end in step])
        offset = 0
        for seq, start, end in step:
            for i in range(end - start):
                rows.append((seq, start + i, logits[offset + i]))
            offset += end - start
    return rows


def assert_rows_match(rows, reference, atol, rtol):
    assert len(rows) == sum(len(t) for t in SEQUENCES.values())
    for seq, pos, row in rows:
        torch.testing.assert_close(
            row, reference[seq][pos], atol=atol, rtol=rtol, msg=f"sequence {seq} position {pos}"
        )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_path_matches_transformers(name):
    hf, ours = hf_and_ours(CONFIGS[name])
    assert_rows_match(run_schedule(ours, torch.float32), hf_logits(hf), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_triton_path_matches_transformers(name, triton_backend):
    hf, ours = hf_and_ours(CONFIGS[name])
    assert_rows_match(run_schedule(ours, torch.float32), hf_logits(hf), atol=1e-3, rtol=1e-3)


def test_triton_path_float16_matches_transformers(triton_backend):
    name = "llama-gqa4-llama3-rope"
    hf, ours = hf_and_ours(CONFIGS[name], dtype=torch.float16)
    assert_rows_match(run_schedule(ours, torch.float16), hf_logits(hf), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_triton_matches_transformers_on_gpu(name, dtype, triton_backend):
    hf, ours = hf_and_ours(CONFIGS[name], dtype=dtype, device="cuda")
    with torch.device("cuda"):
        runner_rows = run_schedule(ours, dtype)
    rows = [(seq, pos, row.cpu()) for seq, pos, row in runner_rows]
    tolerance = 3e-2 if dtype is torch.float16 else 8e-2
    assert_rows_match(rows, hf_logits(hf), atol=tolerance, rtol=tolerance)
