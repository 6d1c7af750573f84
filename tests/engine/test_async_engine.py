"""AsyncEngine behaviour on the default model: streaming, seeds, stops, aborts, logprobs."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from aioserve import AsyncEngine, RequestOutputKind, SamplingParams
from aioserve.config.engine import engine_config_from_kwargs
from tests.engine.smollm2 import collect, float32_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    engine = float32_engine(smollm2_gguf, max_model_len=2048)
    yield engine
    asyncio.run(engine.shutdown())


def run(coro):
    return asyncio.run(coro)


def chat(engine, text: str) -> dict:
    tokenizer = engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {
        "prompt": rendered,
        "prompt_token_ids": tokenizer(rendered, add_special_tokens=False).input_ids,
    }


def test_seeded_request_is_the_same_alone_and_in_a_batch(engine):
    params = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True
    )
    prompt = "Once upon a time in a small village,"

    async def alone():
        outs = await collect(engine, prompt, params, "alone")
        return outs[-1].outputs[0].token_ids

    async def in_batch():
        others = [
            collect(
                engine,
                f"Story number {i}: the dragon",
                SamplingParams(temperature=1.0, max_tokens=30 + i),
                f"other{i}",
            )
            for i in range(5)
        ]
        results = await asyncio.gather(collect(engine, prompt, params, "batched"), *others)
        return results[0][-1].outputs[0].token_ids

    first = run(alone())
    assert len(first) == 24
    assert run(in_batch()) == first
    unseeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)
    other = run(collect(engine, prompt, unseeded, "unseeded"))[-1].outputs[0].token_ids
    assert other != first, "an unseeded request should not replay the seeded stream"


def test_streamed_pieces_add_up_to_the_final_text(engine):
    tokenizer = engine.tokenizer
    for i, text in enumerate(
        [
            "Write a short poem with emoji 🎉🌍 about the sea.",
            "用中文介绍一下长城。",
            "Say 'こんにちは' and '😀' three times.",
        ]
    ):
        params = SamplingParams(temperature=0.0, max_tokens=40, output_kind=RequestOutputKind.DELTA)
        outs = run(collect(engine, chat(engine, text), params, f"stream{i}"))
        pieces = "".join(o.outputs[0].text for o in outs if o.outputs)
        token_ids = [t for o in outs if o.outputs for t in o.outputs[0].token_ids]
        # The full decode may end in U+FFFD where max_tokens cut a character in two: that
        # unfinished character is never emitted; everything before it is.
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        assert pieces == full.rstrip("\ufffd")
        assert "\ufffd" not in pieces
        # Cumulative mode reports the same text in its last output.
        cumulative = run(
            collect(
                engine,
                chat(engine, text),
                SamplingParams(temperature=0.0, max_tokens=40),
                f"cum{i}",
            )
        )
        assert cumulative[-1].outputs[0].text == pieces


def test_stop_string_ends_generation_and_is_excluded(engine):
    base = run(
        collect(
            engine,
            "Count: one, two, three, four,",
            SamplingParams(temperature=0.0, max_tokens=30),
            "base",
        )
    )
    text = base[-1].outputs[0].text
    assert len(text) > 8
    stop = text[4:7]
    out = run(
        collect(
            engine,
            "Count: one, two, three, four,",
            SamplingParams(temperature=0.0, max_tokens=30, stop=[stop]),
            "stop",
        )
    )[-1]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.index(stop)]
    kept = run(
        collect(
            engine,
            "Count: one, two, three, four,",
            SamplingParams(
                temperature=0.0, max_tokens=30, stop=[stop], include_stop_str_in_output=True
            ),
            "stop-kept",
        )
    )[-1]
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]


def test_text_held_back_for_stop_strings_is_released_when_min_tokens_end_the_request(engine):
    """max_tokens == min_tokens: the request ends before any stop string is looked for, and
    the end of its text, held back in case it began a stop string, is still delivered."""
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=6,
            min_tokens=6,
            ignore_eos=True,
            stop=["never in it"],
            output_kind=kind,
        )
        outputs = [out.outputs[0] for out in run(collect(engine, "Count: one,", params, "m"))]
        if kind is RequestOutputKind.DELTA:
            text, token_ids = "", []
            for delta in outputs:
                text += delta.text
                token_ids += delta.token_ids
        else:
            text, token_ids = outputs[-1].text, outputs[-1].token_ids
        assert outputs[-1].finish_reason == "length" and len(token_ids) == 6
        assert text == engine.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_stop_token_ids_max_tokens_and_min_tokens(engine):
    prompt = "The quick brown fox"
    greedy = run(
        collect(
            engine, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), "g"
        )
    )[-1].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop_id = greedy.token_ids[3]
    first_stop = greedy.token_ids.index(stop_id)
    stopped = run(
        collect(
            engine,
            prompt,
            SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]),
            "s",
        )
    )[-1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == greedy.token_ids[: first_stop + 1]
    # min_tokens bans the stop token until the minimum is reached.
    held = run(
        collect(
            engine,
            prompt,
            SamplingParams(
                temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=first_stop + 2
            ),
            "m",
        )
    )[-1].outputs[0]
    assert stop_id not in held.token_ids[: first_stop + 2]


def test_n_samples_and_logprobs(engine):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, logprobs=3, ignore_eos=True)
    out = run(collect(engine, "Tell me a fact:", params, "n2"))[-1]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    for completion in out.outputs:
        assert len(completion.logprobs) == 8
        for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token_id in entry
            assert 3 <= len(entry) <= 4
            assert sorted(lp.rank for lp in entry.values())[:3] == [1, 2, 3]
        assert math.isclose(
            completion.cumulative_logprob,
            sum(
                e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True)
            ),
            rel_tol=1e-5,
        )


def test_greedy_logprobs_equal_log_softmax_of_transformers(engine, smollm2_gguf):
    from tests.engine.smollm2 import hf_model

    prompt_ids = engine.tokenizer("The capital of Italy is").input_ids
    out = run(
        collect(
            engine,
            {"prompt_token_ids": prompt_ids},
            SamplingParams(temperature=0.0, max_tokens=1, logprobs=5),
            "lp",
        )
    )[-1]
    entry = out.outputs[0].logprobs[0]
    with torch.inference_mode():
        logits = hf_model(str(smollm2_gguf))(torch.tensor([prompt_ids])).logits[0, -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    top = torch.topk(reference, 5)
    for rank, (value, token_id) in enumerate(
        zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1
    ):
        assert entry[token_id].rank == rank
        assert math.isclose(entry[token_id].logprob, value, abs_tol=1e-3)


def test_logprob_token_ids_equal_log_softmax_of_transformers(engine, smollm2_gguf):
    from tests.engine.smollm2 import hf_model

    model = hf_model(str(smollm2_gguf))
    prompt_ids = engine.tokenizer("The capital of Italy is").input_ids
    with torch.inference_mode():
        first = int(model(torch.tensor([prompt_ids])).logits[0, -1].argmax())
    chosen = [5, first, 49151]  # the first greedy token among them, out of order
    params = SamplingParams(temperature=0.0, max_tokens=4, logprob_token_ids=chosen)
    beside = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)

    async def batched():  # beside a request that wants its top logprobs
        return await asyncio.gather(
            collect(engine, {"prompt_token_ids": prompt_ids}, params, "chosen"),
            collect(engine, "Name a planet:", beside, "top"),
        )

    outs, others = run(batched())
    sample = outs[-1].outputs[0]
    assert sample.token_ids[0] == first
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + sample.token_ids])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)[len(prompt_ids) - 1 :]
    for token_id, entry, row in zip(sample.token_ids, sample.logprobs, reference, strict=False):
        # The sampled token first, with its own rank (vLLM's would take its place in the
        # list); then the chosen ones, in their order, ranked by their place in it.
        assert list(entry) == [token_id, *(t for t in chosen if t != token_id)]
        assert entry[token_id].rank == 1 + int((row > row[token_id]).sum())
        for place, t in enumerate(chosen, start=1):
            assert math.isclose(entry[t].logprob, float(row[t]), abs_tol=1e-3)
            assert t == token_id or entry[t].rank == place
    cumulative = sum(float(row[t]) for row, t in zip(reference[:-1], sample.token_ids, strict=True))
    assert math.isclose(sample.cumulative_logprob, cumulative, abs_tol=4e-3)
    assert all(len(entry) >= 5 for entry in others[-1].outputs[0].logprobs)


def test_abort_and_vanished_consumer_return_every_block(engine):
    async def scenario():
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = engine.generate("Write a very long story about a lighthouse.", long, "walkaway")
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()  # the consumer goes away mid-stream

        task = asyncio.ensure_future(collect(engine, "Another long story:", long, "aborted"))
        await asyncio.sleep(0.3)
        engine.abort("aborted")
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await asyncio.sleep(0)  # let the engine loop reach its next step boundary

    run(scenario())
    assert engine.num_unfinished_requests == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_bad_requests_are_refused_with_clear_errors(engine):
    async def try_one(prompt, params, request_id):
        return [o async for o in engine.generate(prompt, params, request_id)]

    too_long = {"prompt_token_ids": [1] * 2048}
    with pytest.raises(ValueError, match="maximum context length is 2048 tokens"):
        run(try_one(too_long, SamplingParams(), "long"))
    with pytest.raises(ValueError, match="logprobs"):
        run(try_one("hi", SamplingParams(logprobs=50), "lp"))
    with pytest.raises(ValueError, match="vocabulary"):
        run(try_one({"prompt_token_ids": [10**7]}, SamplingParams(), "vocab"))
    with pytest.raises(ValueError, match="empty"):
        run(try_one({"prompt_token_ids": []}, SamplingParams(), "empty"))
    with pytest.raises(ValueError, match="detokenize"):
        run(try_one("hi", SamplingParams(stop=["x"], detokenize=False), "nodetok"))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_allowed_token_ids_restrict_every_sampled_token(engine):
    allowed = [engine.tokenizer(" yes").input_ids[-1], engine.tokenizer(" no").input_ids[-1]]
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=6, allowed_token_ids=allowed, ignore_eos=True
    )
    out = run(collect(engine, "Answer yes or no:", params, "allowed"))[-1].outputs[0]
    assert len(out.token_ids) == 6 and set(out.token_ids) <= set(allowed)


def test_skip_tokenizer_init_takes_and_returns_token_ids_only(smollm2_gguf):
    bare = AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=str(smollm2_gguf),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=512,
            enforce_eager=True,
        )
    )
    try:
        assert bare.tokenizer is None
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        out = run(collect(bare, {"prompt_token_ids": [1, 504, 3458, 314]}, params, "ids"))[-1]
        assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
        with pytest.raises(ValueError, match="tokenizer"):
            run(collect(bare, "a text prompt", params, "text"))
        with pytest.raises(ValueError, match="tokenizer"):
            run(collect(bare, {"prompt_token_ids": [1, 2]}, SamplingParams(stop=["x"]), "stop"))
    finally:
        run(bare.shutdown())


class RecordingStatLogger:
    def __init__(self) -> None:
        self.steps = []

    def record(self, stats) -> None:
        self.steps.append(stats)


def test_step_stats_add_up_to_what_was_generated(engine):
    recorder = RecordingStatLogger()
    engine.stat_loggers.append(recorder)
    prompts = {"s1": "The capital of Italy is", "s2": "Water boils at"}
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)

    async def both():
        outs = await asyncio.gather(
            *(collect(engine, p, params, rid) for rid, p in prompts.items())
        )
        agen = engine.generate("Count: one, two,", SamplingParams(max_tokens=50), "s3")
        await agen.__anext__()
        await agen.aclose()  # aborts s3 between steps
        return outs

    try:
        outs = run(both())
    finally:
        engine.stat_loggers.remove(recorder)
    steps = recorder.steps
    prompt_lens = [len(o[-1].prompt_token_ids) for o in outs]
    assert sum(s.num_generation_tokens for s in steps) == 2 * 7 + 1
    assert sum(s.num_prompt_tokens for s in steps) >= sum(prompt_lens)
    assert sum(len(s.time_to_first_tokens) for s in steps) == 3
    assert sum(len(s.inter_token_latencies) for s in steps) == 2 * 6
    finished = {f.finish_reason: f for s in steps for f in s.finished}
    # The aborted s3 is not among the finished (vLLM's abort records no per-request stats).
    assert sorted(f.finish_reason for s in steps for f in s.finished) == ["length", "length"]
    length = finished["length"]
    assert length.num_generation_tokens == 7 and length.max_tokens_param == 7 and length.n == 1
    assert length.e2e_latency >= length.inference_time >= length.decode_time > 0
    assert length.mean_time_per_output_token == pytest.approx(length.decode_time / 6)
    last = steps[-1]
    assert (last.num_running, last.num_waiting, last.kv_cache_usage) == (0, 0, 0.0)
