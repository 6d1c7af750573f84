"""--stream-interval and a request's stream_interval (vLLM 0.32): a DELTA stream sends its
first token at once, then a chunk each time `interval` tokens gathered, and the rest when
it ends; the chunks join into the final-only answer. A request may raise the engine's
interval, never lower it; n samples are paced each on its own."""

from __future__ import annotations

import asyncio

import pytest

from aioserve import AsyncEngine, RequestOutputKind, SamplingParams
from aioserve.config.engine import engine_config_from_kwargs
from tests.engine.smollm2 import collect
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

PROMPT = {"prompt_token_ids": list(range(5, 25))}
MAX_TOKENS = 11


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


def _engine(folder, interval: int) -> AsyncEngine:
    return AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=str(folder),
            dtype="float32",
            max_model_len=128,
            block_size=16,
            skip_tokenizer_init=True,
            enforce_eager=True,
            stream_interval=interval,
        )
    )


def _chunks(engine, params: SamplingParams, request_id: str) -> list[list[list[int]]]:
    """Each output's token ids, per sample."""
    outputs = asyncio.run(collect(engine, PROMPT, params, request_id))
    chunks = [[[] for _ in range(params.n)] for _ in outputs]
    for i, output in enumerate(outputs):
        for sample in output.outputs:
            chunks[i][sample.index] = list(sample.token_ids)
    return chunks


def _params(**more) -> SamplingParams:
    more.setdefault("temperature", 0.0)
    more.setdefault("output_kind", RequestOutputKind.DELTA)
    return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **more)


@pytest.mark.parametrize(
    ("engine_interval", "request_interval", "sizes"),
    [
        (1, None, [1] * MAX_TOKENS),
        (1, 4, [1, 4, 4, 2]),
        (4, None, [1, 4, 4, 2]),
        (4, 2, [1, 4, 4, 2]),  # a request cannot lower the engine's
        (3, 5, [1, 5, 5]),
        (1, 20, [1, 10]),
    ],
)
def test_chunks_gather_the_interval_and_join_into_the_answer(
    llama_folder, engine_interval, request_interval, sizes
):
    engine = _engine(llama_folder, engine_interval)
    try:
        chunks = _chunks(engine, _params(stream_interval=request_interval), "paced")
        final = asyncio.run(
            collect(
                engine, PROMPT,
                _params(output_kind=RequestOutputKind.FINAL_ONLY, stream_interval=request_interval),
                "final",
            )
        )  # fmt: skip
    finally:
        asyncio.run(engine.shutdown())
    assert [len(c[0]) for c in chunks] == sizes
    assert sum((c[0] for c in chunks), []) == final[-1].outputs[0].token_ids


def test_n_samples_are_paced_each_on_its_own(llama_folder):
    engine = _engine(llama_folder, 1)
    try:
        chunks = _chunks(engine, _params(n=2, temperature=1.0, seed=3, stream_interval=3), "two")
    finally:
        asyncio.run(engine.shutdown())
    for index in (0, 1):
        sizes = [len(c[index]) for c in chunks if c[index]]
        assert sizes == [1, 3, 3, 3, 1], (index, sizes)


def test_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be at least 1"):
        SamplingParams(stream_interval=0)
