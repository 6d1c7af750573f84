"""--cudagraph-metrics: how each model step ran, in vLLM 0.32's terms (CUDAGraphStat).

vLLM's model runner notes, for every step it runs, the step's tokens, the tokens it ran
at once padded to a captured graph's size, the padding, and the CUDA-graph mode it was
dispatched to: "FULL" (a whole captured graph replayed), "PIECEWISE" (captured pieces
between eager attention) or "NONE" (eager). The server's stats logger tallies them
(server/cudagraph_table.py).

aioserve pads only decode steps, to the decode batch sizes (decode_graphs.py), which is
vLLM's FULL_DECODE_ONLY mode; it never runs a step piecewise. So a step is:

- a padded decode replayed from its captured graph (CUDA, ROCm): its batch size, the size
  it was padded to, "FULL";
- a padded decode on the CPU: the size it was padded to, "NONE". The CPU captures no
  graph (the step runs through the ordinary forward at the padded size), so the padding
  is real but the step is eager; claiming "FULL" would report a graph replay that never
  happened. vLLM-CPU, which does not pad at all, reports every step "NONE" too;
- any other step (a prefill or mixed step, a decode too large or too long for the
  graphs, a step with drafts, every step under --enforce-eager or cudagraph_mode NONE,
  a pooling model's): its tokens, unpadded, "NONE", as vLLM's dispatcher returns for a
  batch no graph holds.

`CUDAGraphSettings` is the header of vLLM's table: the mode the runner was configured to
and the sizes decode steps are padded to ("Capture sizes"; on the CPU, padded to but not
captured).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CUDAGraphStat:
    """One step as vLLM's CUDAGraphStat describes it."""

    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int
    runtime_mode: str  # vLLM's CUDAGraphMode name: "FULL" or "NONE" here

    @classmethod
    def eager(cls, num_tokens: int) -> CUDAGraphStat:
        """A step that runs its tokens as they are, without a graph."""
        return cls(num_tokens, num_tokens, 0, "NONE")

    @classmethod
    def padded(cls, num_tokens: int, size: int, replayed: bool) -> CUDAGraphStat:
        """A decode step padded to `size`, replayed from a captured graph or not."""
        return cls(num_tokens, size, size - num_tokens, "FULL" if replayed else "NONE")


@dataclass(frozen=True)
class CUDAGraphSettings:
    """The runner's graph settings, as the header of vLLM's table shows them."""

    mode: str = "NONE"  # "FULL_DECODE_ONLY" where decode steps replay graphs, else "NONE"
    capture_sizes: tuple[int, ...] = ()  # the batch sizes decode steps are padded to
