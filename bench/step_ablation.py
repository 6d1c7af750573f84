"""What each part of a one-stream decode step costs: the step with the part taken away.

Runs the offline engine (the compiled step, as served) on one random prompt at a time, and
alternates, request by request in the same process, the full step with the step missing
one part: its time per output token then differs by what that part costs. Alternating in
one process cancels what separate runs cannot on a shared 2-core host, whose speed drifts
by ±10% from one minute to the next (bench/RESULTS.md). A part taken away computes nothing
in its place (zeros, or its input passed on), so the tokens are garbage: this measures
time, never output.

Parts: `attention` (each layer's KV write and paged attention), `kv-write` (the write
alone), `bags` (the decode attention's two weighted sums over the pool,
kernels/decode_in_pool.py), `int4` (torch's int4 products of the layers kept as the GGUF
stores them), `head` (the output head and its logits, sampling kept), `one-row-graph` (the
whole step compiled as one C++ program, runner/one_row_step.py: without it the step takes
the layer graphs). The other parts are swapped where the layer graphs call them, so they
are measured on those, the one-row graph off in both arms.

    python bench/step_ablation.py --parts attention,head,int4 --pairs 10

For each part it prints the mean time per output token with and without it, their mean
difference over the pairs with its standard deviation, and in how many pairs the step
without the part was faster.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable
from unittest.mock import patch

from one_stream import one_request_at_a_time  # bench/, the script's own directory


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args()
    args.parts = args.parts.split(",")
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    return args


def without_attention() -> contextlib.AbstractContextManager:
    from aioserve.models import paged_attention_op

    stack = contextlib.ExitStack()
    stack.enter_context(without_kv_write())
    stack.enter_context(
        patch.object(paged_attention_op, "paged_attention", lambda query, *a, **k: query.clone())
    )
    return stack


def without_kv_write() -> contextlib.AbstractContextManager:
    from aioserve.models import paged_attention_op

    return patch.object(paged_attention_op, "write_kv_cache", lambda *a, **k: None)


def without_bags() -> contextlib.AbstractContextManager:
    from aioserve.kernels import decode_in_pool

    def zeros(table, rows, offsets, weights):
        return table.new_zeros(offsets.shape[0], table.shape[1])

    return patch.object(decode_in_pool, "_weighted_sums", zeros)


def without_int4() -> contextlib.AbstractContextManager:
    from aioserve.models import linear

    def zeros(x, packed, scales_and_zeros, bias=None):
        return x.new_zeros(x.shape[0], scales_and_zeros.shape[1])

    return patch.object(linear, "int4_linear", zeros)


def without_head() -> contextlib.AbstractContextManager:
    import torch

    from aioserve.runner.compiled_step import ModelStep

    original = ModelStep.logits

    def logits(step, hidden):
        if hidden.shape[0] != 1:
            return original(step, hidden)
        return torch.zeros(1, step.model.config.vocab_size, device=hidden.device)

    return patch.object(ModelStep, "logits", logits)


def without_one_row_graph() -> contextlib.AbstractContextManager:
    from aioserve.runner.compiled_step import ModelStep
    from aioserve.runner.one_row_step import OneRowStep

    stack = contextlib.ExitStack()
    stack.enter_context(patch.object(OneRowStep, "serves", lambda self, *args: False))
    # Its steps then get the attention plan the layer graphs read.
    stack.enter_context(patch.object(ModelStep, "may_run_whole", lambda self, plan: False))
    return stack


PARTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "attention": without_attention,
    "kv-write": without_kv_write,
    "bags": without_bags,
    "int4": without_int4,
    "head": without_head,
    "one-row-graph": without_one_row_graph,
}


def main() -> None:
    args = parse_args()
    generate = one_request_at_a_time(args.model, args.input_len, args.output_len)

    def per_token() -> float:
        one = generate(1)
        return (generate(args.output_len + 1) - one) / args.output_len * 1e3

    print(f"one stream, {args.input_len} in / {args.output_len} out, {args.pairs} pairs a part")
    print("part        with (ms)  without (ms)  difference (ms)   without faster")
    for part in args.parts:
        # The one-row graph calls what it compiled, not the functions these parts swap.
        on_layer_graphs = without_one_row_graph if part != "one-row-graph" else None
        with on_layer_graphs() if on_layer_graphs else contextlib.nullcontext():
            with PARTS[part]():
                generate(8)
            full, ablated = [], []
            for pair in range(args.pairs):
                for take_away in (False, True) if pair % 2 == 0 else (True, False):
                    with PARTS[part]() if take_away else contextlib.nullcontext():
                        (ablated if take_away else full).append(per_token())
        diffs = [a - f for f, a in zip(full, ablated, strict=True)]
        spread = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
        faster = sum(d < 0 for d in diffs)
        print(
            f"{part:10s} {statistics.mean(full):9.2f} {statistics.mean(ablated):12.2f} "
            f"{statistics.mean(diffs):+9.2f} ± {spread:4.2f} {faster:10d}/{len(diffs)}"
        )


if __name__ == "__main__":
    main()
