"""What a JSON schema costs: 64 concurrent constrained requests against the same 64 without.

Runs the engine in this process (the server's defaults: the compiled step, dtype auto),
warms it up, then times three rounds of each kind, alternating: 64 chat prompts asking for
a JSON record, all sent at once, each generating exactly MAX_TOKENS tokens (ignore_eos, so
that both kinds generate as many tokens and only the cost of the constraint differs: a
finished JSON keeps its mask, which then allows only EOS). Prints generated tokens per
second for each kind, their ratio, and how long a new schema takes to compile for its
first request (the backend the compiler chose, and with it the tokenizer's one-time
vocabulary build).

    python bench/structured_outputs.py            # the outlines path (no numeric bounds)
    python bench/structured_outputs.py --guidance  # a schema with bounds: llguidance
    python bench/structured_outputs.py --backend xgrammar  # the record schema, one backend
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

from aioserve import AsyncEngine
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams

NUM_REQUESTS = 64
MAX_TOKENS = 96
ROUNDS = 3
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "city": {"type": "string", "maxLength": 16},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "city", "hobbies", "member"],
    "additionalProperties": False,
}
BOUNDED = {
    **RECORD,
    "properties": {
        **RECORD["properties"],
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}


async def run_round(engine: AsyncEngine, prompts: list[str], constraint) -> float:
    """Generated tokens per second for all prompts at once."""

    async def one(index: int, prompt: str) -> int:
        params = SamplingParams(
            temperature=0.8, seed=index, max_tokens=MAX_TOKENS, ignore_eos=True,
            structured_outputs=constraint,
        )  # fmt: skip
        final = None
        async for output in engine.generate(prompt, params, f"r{time.monotonic_ns()}-{index}"):
            final = output
        return len(final.outputs[0].token_ids)

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts) / (time.perf_counter() - start)


async def main() -> None:
    schema = BOUNDED if "--guidance" in sys.argv else RECORD
    engine = AsyncEngine.from_config(engine_config_from_kwargs(max_num_seqs=NUM_REQUESTS))
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Invent member number {i} of a club, as JSON."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(NUM_REQUESTS)
    ]
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else None
    constraint = StructuredOutputsParams(json=schema, backend=backend)
    start = time.perf_counter()
    await engine.compile_structured_output(SamplingParams(structured_outputs=constraint))
    first_compile = time.perf_counter() - start
    backend = type(engine.structured_outputs.compile(constraint)).__name__
    await run_round(engine, prompts[:8], None)  # warm-up
    await run_round(engine, prompts[:8], constraint)
    free, constrained = [], []
    for _ in range(ROUNDS):
        free.append(await run_round(engine, prompts, None))
        constrained.append(await run_round(engine, prompts, constraint))
    print(f"first compile of the schema: {first_compile:.2f} s ({backend})")
    print(f"unconstrained: {', '.join(f'{x:.0f}' for x in free)} generated tok/s")
    print(f"JSON schema:   {', '.join(f'{x:.0f}' for x in constrained)} generated tok/s")
    ratio = statistics.median(constrained) / statistics.median(free)
    print(f"constrained / unconstrained (medians): {ratio:.3f}")
    await engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
