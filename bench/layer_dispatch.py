"""What checking the compiled layer's guards once a step saves (runner/layer_dispatch.py).

One offline engine (the compiled step, as served) runs decode steps of --rows sequences;
step by step it alternates between the layers as served (the guards checked on the first
layer, the other layers calling their graph directly) and every layer called through
torch.compile's wrapper (guards and frame evaluation on each call, as before). Alternating
in one process keeps the host's drift out of the comparison. Prints each way's median step.

    python bench/layer_dispatch.py --rows 64 --output-len 48 --repeats 3
    python bench/layer_dispatch.py --rows 1 --output-len 128
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time

from aioserve import host_memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--rows", type=int, default=64, help="sequences decoding together")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    host_memory.keep_host_memory()  # before torch is imported, as the CLI does
    from aioserve import LLM, SamplingParams
    from aioserve.runner import model_runner

    llm = LLM(model=args.model, seed=0, max_num_batched_tokens=2048, max_model_len=2048)
    rng = random.Random(0)
    vocab = llm.get_tokenizer().vocab_size
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)

    def prompts(count: int) -> list[dict]:
        return [
            {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
            for _ in range(count)
        ]

    llm.generate(prompts(2), params, use_tqdm=False)
    execute = model_runner.ModelRunner.execute
    times: dict[str, list[float]] = {"guards once a step": [], "guards every layer": []}
    forwards: dict[str, list] = {}
    count = [0]

    def alternating(self, step):
        dispatch = self.model_step._layers
        if not forwards:
            forwards["guards once a step"] = [layer.forward for layer in dispatch._modules]
            forwards["guards every layer"] = [
                functools.partial(dispatch._compiled, layer) for layer in dispatch._modules
            ]
        way = list(times)[count[0] % 2]
        count[0] += 1
        for layer, forward in zip(dispatch._modules, forwards[way], strict=True):
            layer.forward = forward
        start = time.perf_counter()
        result = execute(self, step)
        if int(step.inputs.input_ids.shape[0]) == args.rows:
            times[way].append(time.perf_counter() - start)
        return result

    model_runner.ModelRunner.execute = alternating
    for _ in range(args.repeats):
        llm.generate(prompts(args.rows), params, use_tqdm=False)
    for way, steps in times.items():
        print(
            f"{args.rows} rows, {way}: {len(steps)} steps, median {statistics.median(steps) * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
