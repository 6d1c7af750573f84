"""Random request programs against the real engine on a stand-in runner, overlap on and off.

Each program admits requests (n samples, token stop conditions, logprobs, long prompts in a
small KV pool so that preemption happens), lets the engine run a little, aborts some and
disconnects others. The stand-in runner samples tokens that depend only on each sample's
seed and index, and checks the step contract itself (a sequence it does not hold, a decode
of a token it did not sample the step before). Whatever the program:

- every stream ends exactly once, its last output finished, none after it;
- a sample that was not cut short holds exactly the tokens the stop rules allow (nothing
  sampled after its EOS or past max_tokens slips through, one step late or not), in its
  last cumulative output or in its deltas added up, however many steps each covers;
- those samples are the same with asynchronous scheduling on and off;
- at the end no request is left and the KV pool is whole.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.outputs import CompletionOutput
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams
from aioserve.engine.stand_in_parts import engine_parts_around
from aioserve.runner.stand_in_runner import StandInRunner, stand_in_token

VOCAB = 300
EOS = 2
NUM_BLOCKS = 14
BLOCK_SIZE = 4
MAX_MODEL_LEN = 40


@dataclass
class Stream:
    outputs: list = field(default_factory=list)
    error: BaseException | None = None
    cut: bool = False  # aborted or disconnected by the program


def expected_sample(prompt_len: int, params: SamplingParams, seed: int) -> tuple[list[int], str]:
    """The tokens and finish reason of an uninterrupted stand-in sample (the engine's rules)."""
    max_tokens = min(params.max_tokens, MAX_MODEL_LEN - prompt_len)
    tokens: list[int] = []
    while True:
        index = len(tokens)
        token = stand_in_token(seed, index, VOCAB)
        if seed % 3 == 0 and index == 3 + seed % 7:
            token = EOS
        tokens.append(token)
        if len(tokens) >= params.min_tokens and not params.ignore_eos and token == EOS:
            return tokens, "stop"
        if len(tokens) >= params.min_tokens and token in params.stop_token_ids:
            return tokens, "stop"
        if len(tokens) >= max_tokens:
            return tokens, "length"


requests = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 30),
        "max_tokens": st.integers(1, 14),
        "n": st.integers(1, 3),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(0, 5),
        "stop_token_ids": st.lists(st.integers(3, VOCAB - 1), max_size=3),
        "seed": st.integers(0, 2**20),
        "logprobs": st.sampled_from([None, 1]),
        "kind": st.sampled_from(list(RequestOutputKind)),
    }
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), requests),
        st.tuples(st.just("wait"), st.integers(0, 8)),
        st.tuples(st.just("abort"), st.integers(0, 9)),
        st.tuples(st.just("disconnect"), st.integers(0, 9)),
    ),
    min_size=1,
    max_size=24,
)


def params_of(spec: dict) -> SamplingParams:
    return SamplingParams(
        n=spec["n"],
        max_tokens=spec["max_tokens"],
        ignore_eos=spec["ignore_eos"],
        min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
        stop_token_ids=spec["stop_token_ids"],
        seed=spec["seed"],
        logprobs=spec["logprobs"],
        output_kind=spec["kind"],
    )


async def consume(engine: AsyncEngine, request_id: str, spec: dict, stream: Stream) -> None:
    prompt = [(7 * i + spec["seed"]) % (VOCAB - 3) + 3 for i in range(spec["prompt_len"])]
    try:
        async for out in engine.generate({"prompt_token_ids": prompt}, params_of(spec), request_id):
            stream.outputs.append(out)
    except asyncio.CancelledError:
        pass
    except Exception as error:  # noqa: BLE001 - recorded and asserted on
        stream.error = error


@dataclass
class Run:
    streams: dict[str, tuple[dict, Stream]]
    num_preemptions: int
    num_sampled_rows: int  # rows the runner sampled, kept or not


def engine_on(runner: StandInRunner, async_scheduling: bool, **settings) -> AsyncEngine:
    """The real engine on the stand-in, in a small KV pool."""
    return AsyncEngine(
        engine_parts_around(
            runner,
            vocab_size=VOCAB,
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            async_scheduling=async_scheduling,
            **settings,
        )
    )


async def run_program(program: list, async_scheduling: bool) -> Run:
    runner = StandInRunner(VOCAB, eos_token_id=EOS, eos_every=3)
    engine = engine_on(
        runner,
        async_scheduling,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        eos_token_ids=frozenset({EOS}),
    )
    streams: dict[str, tuple[dict, Stream]] = {}
    tasks: list[asyncio.Task] = []
    try:
        for op, arg in program:
            ids = list(streams)
            if op == "add":
                request_id = f"r{len(streams)}"
                streams[request_id] = (arg, Stream())
                tasks.append(
                    asyncio.create_task(consume(engine, request_id, arg, streams[request_id][1]))
                )
            elif op == "wait":
                for _ in range(arg):
                    await asyncio.sleep(0.0005)
            elif ids and op == "abort":
                request_id = ids[arg % len(ids)]
                streams[request_id][1].cut = True
                engine.abort(request_id)
            elif ids and op == "disconnect":
                request_id = ids[arg % len(ids)]
                streams[request_id][1].cut = True
                tasks[arg % len(ids)].cancel()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)
        for _ in range(2000):
            if not engine.scheduler.has_unfinished() and engine.num_unfinished_requests == 0:
                break
            await asyncio.sleep(0.001)
        assert not engine.scheduler.has_unfinished()
        assert engine.num_unfinished_requests == 0
        assert engine.kv_cache.num_free_blocks == NUM_BLOCKS
        assert engine.kv_cache.owners() == {}
    finally:
        await engine.shutdown()
    return Run(streams, engine.scheduler.stats.num_preemptions, runner.num_sampled_rows)


def check_streams(streams: dict[str, tuple[dict, Stream]]) -> None:
    for request_id, (spec, stream) in streams.items():
        assert stream.error is None, (request_id, stream.error)
        finished = [out for out in stream.outputs if out.finished]
        if not stream.cut:
            assert len(finished) == 1 and stream.outputs[-1].finished, request_id
        assert len(finished) <= 1, request_id
        if finished:
            assert stream.outputs[-1].finished  # nothing after the end
        if stream.cut:
            continue
        params = params_of(spec)
        for sample in samples_of(stream, spec["kind"]):
            tokens, reason = expected_sample(spec["prompt_len"], params, params.seed + sample.index)
            assert (list(sample.token_ids), sample.finish_reason) == (tokens, reason), (
                request_id,
                sample.index,
            )
            if params.logprobs is not None:
                assert len(sample.logprobs) == len(tokens)


def samples_of(stream: Stream, kind: RequestOutputKind) -> list[CompletionOutput]:
    """Each sample as its stream delivered it in the end: the last cumulative output, or
    the deltas (merged or not) added up, or the one final output."""
    if kind is RequestOutputKind.CUMULATIVE:
        return stream.outputs[-1].outputs
    joined: dict[int, CompletionOutput] = {}
    for out in stream.outputs:
        for delta in out.outputs:
            sample = joined.setdefault(
                delta.index, CompletionOutput(delta.index, "", [], None, None)
            )
            sample.token_ids = [*sample.token_ids, *delta.token_ids]
            if delta.logprobs is not None:
                sample.logprobs = [*(sample.logprobs or []), *delta.logprobs]
            sample.finish_reason = delta.finish_reason
    return [joined[index] for index in sorted(joined)]  # deltas may come in any sample order


def final_samples(streams) -> dict[str, list]:
    return {
        request_id: [(list(s.token_ids), s.finish_reason) for s in samples_of(stream, spec["kind"])]
        for request_id, (spec, stream) in streams.items()
        if not stream.cut
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=operations)
def test_random_programs_end_every_stream_once_and_return_every_block(program):
    with_overlap = asyncio.run(run_program(program, async_scheduling=True)).streams
    check_streams(with_overlap)
    without = asyncio.run(run_program(program, async_scheduling=False)).streams
    check_streams(without)
    assert final_samples(with_overlap) == final_samples(without)


def test_a_crowded_small_pool_preempts_and_still_gives_every_token_once():
    spec = {
        "prompt_len": 20,
        "max_tokens": 14,
        "n": 1,
        "ignore_eos": True,
        "min_tokens": 0,
        "stop_token_ids": [],
        "logprobs": 1,
        "kind": RequestOutputKind.CUMULATIVE,
    }
    program = [("add", dict(spec, seed=seed)) for seed in range(1, 9)]
    for async_scheduling in (True, False):
        run = asyncio.run(run_program(program, async_scheduling))
        check_streams(run.streams)
        assert run.num_preemptions > 0
        assert all(len(s.outputs[-1].outputs[0].token_ids) == 14 for _, s in run.streams.values())
        # Known ends (max_tokens, no EOS) waste no row, even planned a step ahead.
        assert run.num_sampled_rows == 8 * 14


def test_a_consumer_that_falls_behind_gets_the_steps_it_missed_in_one_delta():
    async def scenario() -> tuple[list, list[int]]:
        engine = engine_on(StandInRunner(VOCAB, step_seconds=0.001), async_scheduling=True)
        params = SamplingParams(
            max_tokens=30, ignore_eos=True, seed=5, output_kind=RequestOutputKind.DELTA
        )
        outputs = []
        try:
            async for out in engine.generate({"prompt_token_ids": [3, 4, 5]}, params, "slow"):
                outputs.append(out)
                await asyncio.sleep(0.05)  # dozens of steps go by before it takes the next
        finally:
            await engine.shutdown()
        tokens, _ = expected_sample(3, params, 5)
        return outputs, tokens

    outputs, tokens = asyncio.run(scenario())
    assert [t for out in outputs for t in out.outputs[0].token_ids] == tokens
    assert len(outputs) < len(tokens) / 2
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
