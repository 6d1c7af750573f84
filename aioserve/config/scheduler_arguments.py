"""vLLM 0.32's newer SchedulerConfig arguments: the scheduled-token budget, the cap on
running requests, the KV watermark, the whole-prompt admission check and the adaptive
long-prefill cap. Declared here (and spliced into `arguments.ARGUMENTS` beside the other
scheduler arguments) to keep arguments.py small; engine/scheduler_limits.py resolves them.
"""

from __future__ import annotations

from typing import Any

from aioserve.config import values
from aioserve.config.declaration import SCHEDULER, Argument


def watermark(value: Any) -> float:
    """--watermark: a fraction in [0, 1), as vLLM's Field(ge=0.0, lt=1.0)."""
    number = values.non_negative_number(value)
    if number >= 1.0:
        raise ValueError(f"must be at least 0 and less than 1, got {value!r}")
    return number


# fmt: off
SCHEDULER_032_ARGUMENTS: tuple[Argument, ...] = (
    Argument("max-num-scheduled-tokens", SCHEDULER, None,
             "Most tokens the scheduler issues in one step, below --max-num-batched-tokens "
             "(which still sizes the model runner's buffers); k/m/g and K/M/G suffixes as "
             "for --max-model-len. Default: --max-num-batched-tokens.",
             convert=values.token_count),
    Argument("max-num-active-seqs", SCHEDULER, None,
             "Most requests running at once (at most --max-num-seqs, which still sizes the "
             "model runner and its decode graphs), so that decode batches stay smaller. "
             "Default: --max-num-seqs.", convert=values.integer_at_least(1)),
    Argument("long-prefill-token-threshold-adaptive", SCHEDULER, False,
             "Floor --long-prefill-token-threshold at a fair share of the step: "
             "--max-num-batched-tokens divided by the requests running and waiting. Only "
             "with a nonzero --long-prefill-token-threshold.", "bool",
             convert=values.boolean),
    Argument("scheduler-reserve-full-isl", SCHEDULER, True,
             "Admit a waiting request only when the KV cache has room for its whole prompt "
             "(its cached prefix shared), not only for its first chunk, so that chunked "
             "prefill does not over-admit and then preempt.", "bool",
             convert=values.boolean),
    Argument("watermark", SCHEDULER, 0.0,
             "Fraction of the KV cache's blocks kept free when a waiting or preempted "
             "request is admitted while others run, so that running requests can grow "
             "without being preempted; in [0, 1). 0: no watermark.",
             convert=watermark),
)
# fmt: on
