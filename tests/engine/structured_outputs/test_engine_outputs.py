"""Structured outputs end to end in the engine, on the default model (SmolLM2-135M).

Every output of a battery of JSON schemas validates (`jsonschema`), greedy and sampled,
with n > 1, all requests running in one batch; regex, choice, grammar (`lark`) and JSON
object outputs satisfy their constraint. With asynchronous scheduling the masks are filled
while the step's forward pass runs: the greedy outputs must be the same. The pool of KV
blocks is whole afterwards, and a constraint with no way forward ends its request.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import lark
import numpy as np
import pytest

from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.structured_outputs import StructuredOutputsParams as Constraint
from tests.engine.smollm2 import float32_engine
from tests.engine.structured_outputs.schemas import SCHEMAS, messages_for

SQL = 'start: "SELECT " NAME " FROM " NAME ";"\nNAME: /[a-z]{1,8}/'
MAX_TOKENS = 160


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def engine(request, smollm2_gguf):
    engine = float32_engine(smollm2_gguf, 1024, async_scheduling=request.param)
    yield engine
    asyncio.run(engine.shutdown())


def chat_prompt(engine, messages) -> str:
    return engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


async def run_all(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, list]:
    async def one(request_id, prompt, params):
        await engine.compile_structured_output(params)
        final = None
        async for output in engine.generate(prompt, params, request_id):
            final = output
        return request_id, final.outputs

    done = await asyncio.gather(*(one(rid, *spec) for rid, spec in requests.items()))
    return dict(done)


def schema_requests(engine) -> dict[str, tuple[str, SamplingParams]]:
    requests = {}
    for name, schema in SCHEMAS.items():
        prompt = chat_prompt(engine, messages_for(schema))
        constraint = Constraint(json=schema)
        settings = {
            "greedy": dict(temperature=0.0),
            "sampled": dict(temperature=0.8, seed=7),
            "n2": dict(temperature=1.0, seed=11, n=2),
        }
        for how, sampling in settings.items():
            params = SamplingParams(
                max_tokens=MAX_TOKENS, structured_outputs=constraint, **sampling
            )
            requests[f"{name}-{how}"] = (prompt, params)
    return requests


@pytest.fixture(scope="module")
def schema_outputs(engine):
    return asyncio.run(run_all(engine, schema_requests(engine)))


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_output_validates_against_its_schema(schema_outputs, name):
    for how in ("greedy", "sampled", "n2"):
        outputs = schema_outputs[f"{name}-{how}"]
        assert len(outputs) == (2 if how == "n2" else 1)
        for output in outputs:
            assert output.finish_reason == "stop", (how, output.text)
            jsonschema.validate(json.loads(output.text), SCHEMAS[name])


def test_greedy_outputs_do_not_depend_on_the_scheduling(schema_outputs, smollm2_gguf, engine):
    if not engine.settings.async_scheduling:
        pytest.skip("compared from the async-scheduling run")
    sync = float32_engine(smollm2_gguf, 1024, async_scheduling=False)
    try:
        greedy = {k: v for k, v in schema_requests(sync).items() if k.endswith("greedy")}
        expected = asyncio.run(run_all(sync, greedy))
    finally:
        asyncio.run(sync.shutdown())
    for request_id, outputs in expected.items():
        assert schema_outputs[request_id][0].text == outputs[0].text, request_id


def test_other_constraints_hold(engine):
    chat = chat_prompt(engine, [{"role": "user", "content": "Write a short SQL query."}])
    yes_no = chat_prompt(engine, [{"role": "user", "content": "Is the sky green?"}])
    phone = chat_prompt(engine, [{"role": "user", "content": "Give me a phone number."}])
    obj = chat_prompt(engine, [{"role": "user", "content": 'Give me the JSON {"a": 1}.'}])

    def params(constraint, **sampling):
        return SamplingParams(max_tokens=60, structured_outputs=constraint, **sampling)

    outputs = asyncio.run(
        run_all(
            engine,
            {
                "regex": (
                    phone,
                    params(Constraint(regex=r"\(\d{3}\) \d{3}-\d{4}"), temperature=0.0),
                ),
                "choice": (yes_no, params(Constraint(choice=["yes", "no"]), temperature=1.0, n=3)),
                "xgrammar": (
                    phone,
                    params(Constraint(regex=r"\d{3}-\d{4}", backend="xgrammar"), temperature=0.8),
                ),
                "grammar": (chat, params(Constraint(grammar=SQL), temperature=0.0)),
                "object": (obj, params(Constraint(json_object=True), temperature=0.0)),
            },
        )
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outputs["regex"][0].text)
    assert {o.text for o in outputs["choice"]} <= {"yes", "no"}
    assert re.fullmatch(r"\d{3}-\d{4}", outputs["xgrammar"][0].text)
    lark.Lark(SQL).parse(outputs["grammar"][0].text)
    assert isinstance(json.loads(outputs["object"][0].text), dict)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_ignore_eos_goes_on_with_eos_alone_once_the_constraint_ended(engine):
    """Every backend's matcher allows only EOS after the constraint's EOS (xgrammar itself
    would refuse to be asked again), so an ignore_eos request runs to max_tokens."""
    prompt = chat_prompt(engine, [{"role": "user", "content": "Is the sky green?"}])
    requests = {
        backend: (
            prompt,
            SamplingParams(
                max_tokens=8,
                temperature=1.0,
                seed=5,
                ignore_eos=True,
                structured_outputs=Constraint(choice=["yes", "no"], backend=backend),
            ),
        )  # fmt: skip
        for backend in ("outlines", "guidance", "xgrammar")
    }
    outputs = asyncio.run(run_all(engine, requests))
    eos = engine.tokenizer.eos_token_id
    for backend, (output,) in outputs.items():
        assert output.text in ("yes", "no"), backend
        assert len(output.token_ids) == 8 and output.finish_reason == "length", backend
        answer = len(engine.tokenizer.encode(output.text, add_special_tokens=False))
        assert set(output.token_ids[answer:]) == {eos}, backend
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_dead_end_ends_the_request_with_an_error(engine, monkeypatch):
    from aioserve.engine.structured_outputs.matchers import OutlinesMatcher

    real_fill = OutlinesMatcher.fill_bitmask
    calls = []

    def fill_then_nothing(self, words: np.ndarray) -> None:
        calls.append(1)
        if len(calls) < 3:
            real_fill(self, words)
        else:
            words.fill(0)  # no token allowed: a dead end

    monkeypatch.setattr(OutlinesMatcher, "fill_bitmask", fill_then_nothing)
    prompt = chat_prompt(engine, [{"role": "user", "content": "Count."}])
    params = SamplingParams(
        max_tokens=50, temperature=0.0, structured_outputs=Constraint(regex="[0-9]{10}")
    )
    outputs = asyncio.run(run_all(engine, {"dead": (prompt, params)}))["dead"]
    assert outputs[0].finish_reason == "error"
    assert re.fullmatch("[0-9]{2}", outputs[0].text)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_the_constraint_waits_for_the_end_of_the_reasoning(engine):
    """The first tokens of the unconstrained greedy answer stand in for a reasoning that
    ends with their text: the output must be that text, then the constrained answer."""
    prompt = chat_prompt(engine, [{"role": "user", "content": "Tell me about Paris."}])
    free = SamplingParams(max_tokens=3, temperature=0.0)
    head = asyncio.run(run_all(engine, {"head": (prompt, free)}))["head"][0].text
    gated = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        structured_outputs=Constraint(regex=" [0-9]{4}"),
        reasoning_end=head,
    )
    (output,) = asyncio.run(run_all(engine, {"gated": (prompt, gated)}))["gated"]
    assert output.text.startswith(head)
    assert re.fullmatch(" [0-9]{4}", output.text[len(head) :]), output.text
    assert output.finish_reason == "stop"


def test_a_reasoning_gate_finds_its_marker_across_pieces():
    from aioserve.engine.structured_outputs.step_masks import ReasoningGate

    text = "thinking hard </think> answer"
    for cut in range(len(text)):
        gate = ReasoningGate("</think>")
        if gate.ended(text[:cut]):
            assert "</think>" in text[:cut]
        else:
            assert "</think>" not in text[:cut]
            assert gate.ended(text)


def test_the_offline_llm_takes_guided_decoding(smollm2_gguf):
    from aioserve import LLM
    from aioserve.engine.structured_outputs import GuidedDecodingParams

    params = SamplingParams(
        max_tokens=20,
        temperature=0.0,
        guided_decoding=GuidedDecodingParams(choice=["Paris", "Rome"]),
    )
    with LLM(model=str(smollm2_gguf), dtype="float32", enforce_eager=True) as llm:
        (output,) = llm.generate(["The capital of France is"], params)
    assert output.outputs[0].text in ("Paris", "Rome")
