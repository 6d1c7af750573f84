"""How long a model step takes with and without drafts, in process, on the default model.

Runs one repetitive prompt greedily (so that nearly every draft is kept) three times with
`--speculative-config` method ngram and `num_speculative_tokens` K, timing each
`ModelRunner.execute` by the number of tokens in its step: 1 is an ordinary decode, 1 + K
a decode and its drafts. A step with drafts is worth it when it keeps more tokens than
its time over a decode's.

    python bench/speculative_steps.py --drafts 4
"""

from __future__ import annotations

import argparse
import statistics
import time

from aioserve import LLM, SamplingParams
from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    speculation = {"method": "ngram", "num_speculative_tokens": args.drafts}
    path = str(resolve_model(DEFAULT_MODEL).path)
    with LLM(model=path, dtype=args.dtype, speculative_config=speculation) as llm:
        runner = llm.engine.runner
        execute = runner.execute
        times: dict[int, list[float]] = {}

        def timed(step):
            started = time.perf_counter()
            output = execute(step)
            tokens = step.inputs.input_ids.size
            times.setdefault(tokens, []).append(time.perf_counter() - started)
            return output

        runner.execute = timed
        prompt = {"prompt_token_ids": llm.get_tokenizer()(PROMPT).input_ids}
        params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        for _ in range(3):
            llm.generate([prompt], params, use_tqdm=False)
        stats = llm.engine.scheduler.stats
    print(f"drafts kept: {stats.num_accepted_tokens} of {stats.num_draft_tokens}")
    print("tokens in step  steps  min ms  median ms")
    for tokens, seconds in sorted(times.items()):
        if tokens <= 1 + args.drafts:
            ms = [s * 1e3 for s in seconds]
            print(f"{tokens:14d} {len(ms):6d} {min(ms):7.2f} {statistics.median(ms):10.2f}")


if __name__ == "__main__":
    main()
