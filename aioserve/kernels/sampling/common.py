"""What every sampling stage shares: the batch and result types, and launch helpers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from aioserve.kernels.triton_compat import triton
from aioserve.platform import launch_entry

# Rows whose temperature is below this are greedy (SamplingParams uses the same bound).
SAMPLING_EPS = 1e-5

# What logprobs report (vLLM's --logprobs-mode; the first is the default): the log-softmax
# or the float32 values themselves, of the logits as the model gave them (raw) or as the
# draw saw them (processed: after bias, bans, penalties, then for random rows temperature
# and the masks, dropped tokens at -inf).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logits", "processed_logprobs")


# Per platform: the widest slice of a row one program holds at a time, how many row
# elements one warp/wavefront should cover, and the most warps per program. A ROCm
# wavefront has 64 lanes, so it covers twice as much.
_CONFIG: dict[str, dict[str, int]] = {
    "cuda": {"max_block": 4096, "elements_per_warp": 512, "max_warps": 8},
    "rocm": {"max_block": 4096, "elements_per_warp": 1024, "max_warps": 8},
    # sm_80: a 1,024-wide block on 2 warps spilled 4 bytes in the temperature scaling.
    "ampere": {"max_block": 4096, "elements_per_warp": 256, "max_warps": 8},
    "cpu": {"max_block": 1024, "elements_per_warp": 256, "max_warps": 1},
}


@dataclass
class SamplingBatch:
    """One step's sampling settings, one row per sampled sequence, on the logits' device."""

    temperature: Tensor  # [B] float32; below SAMPLING_EPS (e.g. 0.0) means greedy
    top_k: Tensor  # [B] int32; <= 0 or >= vocab means no top-k
    top_p: Tensor  # [B] float32; 1.0 means no top-p
    min_p: Tensor  # [B] float32; 0.0 means no min-p
    seeds: Tensor  # [B] int64; every row has one (the engine draws it if unseeded)
    steps: Tensor  # [B] int64; index of the token being sampled in the request's output
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    repetition_penalty: Tensor  # [B] float32
    output_token_counts: Tensor | None  # [R, V] int32; None when no row uses penalties
    prompt_token_mask: Tensor | None  # [R, V] bool; None when no row uses repetition_penalty
    bias_token_ids: Tensor | None  # [B, K] int64, padded with -1
    bias_values: Tensor | None  # [B, K] float32; -inf bans the token
    num_logprobs: int  # most top logprobs asked for in the batch; 0: none; -1: no logprobs
    all_greedy: bool
    all_random: bool
    # [B] int64: the row of output_token_counts / prompt_token_mask that each batch row
    # reads (the runner keeps them per sequence slot). None: batch row b reads row b.
    state_rows: Tensor | None = None
    # The tokens some rows may sample, as bitmasks (token_bitmask.py): [M, ceil(V / 32)]
    # int32, and [M] int64 the batch row each constrains. None: every token allowed.
    token_bitmask: Tensor | None = None
    bitmask_rows: Tensor | None = None
    # Whether any row may use top-k / top-p: False lets the Triton path skip their passes.
    uses_top_k: bool = True
    uses_top_p: bool = True
    logprobs_mode: str = "raw_logprobs"  # one of LOGPROBS_MODES

    @property
    def reports_processed(self) -> bool:
        """Whether logprobs report the processed values (processed_logits/_logprobs)."""
        return self.logprobs_mode.startswith("processed_")

    def checked_logprobs_mode(self) -> str:
        """`logprobs_mode`; a ValueError unless it is one of LOGPROBS_MODES."""
        if self.logprobs_mode not in LOGPROBS_MODES:
            modes = ", ".join(LOGPROBS_MODES)
            raise ValueError(f"logprobs mode {self.logprobs_mode!r} is not one of {modes}")
        return self.logprobs_mode


@dataclass
class LogprobsTensors:
    # The values are as the logprobs mode says (raw logprobs by default), and so are the
    # ranks: counted over the values the mode reports, before any log-softmax.
    sampled_logprob: Tensor  # [B] float32: the sampled token's value
    sampled_rank: Tensor  # [B] int64: 1 + number of tokens with a strictly higher value
    top_token_ids: Tensor  # [B, num_logprobs] int64, by descending logprob, ties by lower id
    top_logprobs: Tensor  # [B, num_logprobs] float32


@dataclass
class SamplerOutput:
    token_ids: Tensor  # [B] int64
    logprobs: LogprobsTensors | None  # when num_logprobs >= 0
    # [B, V] float32: in the processed modes, when num_logprobs >= 0, the processed logits
    # the logprobs were taken from (the runner reads logprob_token_ids' values there).
    processed: Tensor | None = None


def make_sampling_batch(
    num_rows: int,
    *,
    device: torch.device | str = "cpu",
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] = -1,
    top_p: float | Sequence[float] = 1.0,
    min_p: float | Sequence[float] = 0.0,
    seeds: int | Sequence[int] = 0,
    steps: int | Sequence[int] = 0,
    presence_penalty: float | Sequence[float] = 0.0,
    frequency_penalty: float | Sequence[float] = 0.0,
    repetition_penalty: float | Sequence[float] = 1.0,
    output_token_counts: Tensor | None = None,
    prompt_token_mask: Tensor | None = None,
    logit_bias: Sequence[Mapping[int, float]] | None = None,
    num_logprobs: int = -1,
    token_bitmask: Tensor | None = None,
    bitmask_rows: Tensor | None = None,
    logprobs_mode: str = "raw_logprobs",
) -> SamplingBatch:
    """A SamplingBatch from per-row values (a scalar applies to every row); for tests and
    the runner's warm-up."""

    def rows(value: float | Sequence[float], dtype: torch.dtype) -> Tensor:
        values = [value] * num_rows if isinstance(value, (int, float)) else list(value)
        return torch.tensor(values, dtype=dtype, device=device)

    temperature_t = rows(temperature, torch.float32)
    top_k_t, top_p_t = rows(top_k, torch.int32), rows(top_p, torch.float32)
    bias_ids = bias_values = None
    width = max((len(b) for b in logit_bias), default=0) if logit_bias is not None else 0
    if width:
        bias_ids = torch.full((num_rows, width), -1, dtype=torch.int64)
        bias_values = torch.zeros((num_rows, width), dtype=torch.float32)
        for row, bias in enumerate(logit_bias):
            bias_ids[row, : len(bias)] = torch.tensor(list(bias.keys()), dtype=torch.int64)
            bias_values[row, : len(bias)] = torch.tensor(list(bias.values()))
        bias_ids, bias_values = bias_ids.to(device), bias_values.to(device)
    return SamplingBatch(
        temperature=temperature_t,
        top_k=top_k_t,
        top_p=top_p_t,
        min_p=rows(min_p, torch.float32),
        seeds=rows(seeds, torch.int64),
        steps=rows(steps, torch.int64),
        presence_penalty=rows(presence_penalty, torch.float32),
        frequency_penalty=rows(frequency_penalty, torch.float32),
        repetition_penalty=rows(repetition_penalty, torch.float32),
        output_token_counts=output_token_counts,
        prompt_token_mask=prompt_token_mask,
        bias_token_ids=bias_ids,
        bias_values=bias_values,
        num_logprobs=num_logprobs,
        all_greedy=bool((temperature_t < SAMPLING_EPS).all()),
        all_random=bool((temperature_t >= SAMPLING_EPS).all()),
        token_bitmask=token_bitmask,
        bitmask_rows=bitmask_rows,
        uses_top_k=bool((top_k_t > 0).any()),
        uses_top_p=bool((top_p_t < 1.0).any()),
        logprobs_mode=logprobs_mode,
    )


def _launch_config(width: int) -> tuple[int, int]:
    """Block size and warps for a row walk over `width` elements."""
    config = launch_entry(_CONFIG)
    block = min(triton.next_power_of_2(width), config["max_block"])
    num_warps = max(1, min(config["max_warps"], block // config["elements_per_warp"]))
    return block, num_warps


def _rows(t: Tensor) -> Tensor:
    """`t` with unit stride along its last dimension (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows_where(flags: Tensor) -> slice | Tensor:
    """Index of the rows where `flags` holds: a slice (no copy) when it holds for all."""
    return slice(None) if bool(flags.all()) else flags.nonzero().squeeze(1)
