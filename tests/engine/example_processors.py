"""Two custom logits processors for the tests (--logits-processors): `NoRepeat`, vLLM's
adapter over a per-request function, and `ForceToken`, a batch processor that keeps its
own per-index state from the batch updates."""

from __future__ import annotations

from aioserve.logits_processor import AdapterLogitsProcessor, LogitsProcessor, MoveDirectionality


class NoRepeat(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        args = params.extra_args or {}
        banned = list(args.get("banned", ()))
        if not banned and not args.get("no_repeat") and not args.get("no_prompt_tokens"):
            return None

        def without_prompt(prompt_ids, output_ids, row):
            row[prompt_ids] = float("-inf")
            return without(output_ids, row)

        def without(output_ids, row):
            if args.get("no_repeat") and output_ids:
                row[output_ids[-1]] = float("-inf")
            row[banned] = float("-inf")
            return row

        return without_prompt if args.get("no_prompt_tokens") else without


class ForceToken(LogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        self.vocab_size = config.vocab_size
        self.targets: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an integer, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.targets.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            self.targets.pop(index, None) if target is None else self.targets.update(
                {index: target}
            )
        for a, b, how in batch_update.moved:
            at_a, at_b = self.targets.pop(a, None), self.targets.pop(b, None)
            if at_a is not None:
                self.targets[b] = at_a
            if at_b is not None and how is MoveDirectionality.SWAP:
                self.targets[a] = at_b

    def apply(self, logits):
        for index, target in self.targets.items():
            kept = logits[index, target].clone()
            logits[index] = float("-inf")
            logits[index, target] = kept
        return logits
