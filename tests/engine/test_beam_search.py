"""Beam search (vLLM 0.32's) on a tiny Llama, against a reference written from its
definition over transformers' float32 logits (tests/engine/beam_reference.py): the same
beams in the same order with the same cumulative logprobs, with and without a length
penalty, with EOS in play (the model's EOS is set to a token its beams do take), and
ignore_eos; offline (`LLM.beam_search`, vLLM's BeamSearchOutput) and in the served shape
(`beam_search_output`: the generated tokens, EOS dropped, finish reasons).
"""

from __future__ import annotations

import collections
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from aioserve import LLM, BeamSearchParams
from aioserve.engine.beam_search import BeamSearchOutput, beam_search_output, beam_search_score
from tests.engine.beam_reference import reference_beam_search, transformers_logprobs
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

PROMPTS = [list(range(start, start + 6)) for start in range(3, 60, 11)]
WIDTH, STEPS = 3, 8
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def next_logprobs(folder):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return transformers_logprobs(model)


@pytest.fixture(scope="module")
def eos(folder, next_logprobs) -> int:
    """An EOS the beams meet: the token the best beams (searched without one) take most
    often after their first two, written into the model's configs."""
    taken: collections.Counter[int] = collections.Counter()
    for prompt in PROMPTS:
        for beam in reference_beam_search(next_logprobs, prompt, WIDTH, STEPS, eos=-1):
            taken.update(beam.tokens[len(prompt) + 2 :])
    eos = taken.most_common(1)[0][0]
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        config = json.loads(path.read_text())
        config["eos_token_id"] = eos
        path.write_text(json.dumps(config))
    return eos


@pytest.fixture(scope="module")
def llm(folder, eos):
    with LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        skip_tokenizer_init=True,
        enforce_eager=True,
    ) as llm:
        yield llm


def search(llm, params, prompts=PROMPTS, **kwargs) -> list[BeamSearchOutput]:
    return llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, **kwargs)


def assert_same_beams(got, expected) -> None:
    assert [s.tokens for s in got] == [b.tokens for b in expected]
    for sequence, beam in zip(got, expected, strict=True):
        assert sequence.cum_logprob == pytest.approx(beam.cum_logprob, abs=1e-3)
        assert len(sequence.logprobs) == len(beam.tokens) - len(
            sequence.orig_prompt["prompt_token_ids"]
        )


def test_eos_is_in_play(next_logprobs, eos):
    """The cases below meet finished and live beams, in the answer and ranked together."""
    found = [
        reference_beam_search(next_logprobs, p, WIDTH, STEPS, eos, length_penalty=penalty)
        for p in PROMPTS
        for penalty in (0.0, 1.0, 2.0)
    ]
    assert any(b.finished for beams in found for b in beams)
    assert any(
        any(b.finished for b in beams) and not all(b.finished for b in beams) for beams in found
    )
    # The length penalty changes some answer: it ranks finished (shorter) and live beams.
    by_penalty = [[b.tokens for b in beams] for beams in found]
    assert by_penalty[1::3] != by_penalty[2::3]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_offline_beams_are_the_references(llm, next_logprobs, eos, length_penalty):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, length_penalty=length_penalty)
    outputs = search(llm, params)
    assert len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = reference_beam_search(
            next_logprobs, prompt, WIDTH, STEPS, eos, length_penalty=length_penalty
        )
        assert_same_beams(output.sequences, expected)
        for sequence in output.sequences:
            # vLLM's offline shape: the prompt's tokens first, a final EOS kept, no reason.
            assert sequence.tokens[: len(prompt)] == prompt
            assert sequence.finish_reason is None and sequence.text is None
        scores = [beam_search_score(s.tokens, s.cum_logprob, frozenset({eos}), length_penalty) for s in output.sequences]  # fmt: skip
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize(("width", "steps"), [(1, 6), (2, 5), (5, 4)])
def test_other_widths_and_ignore_eos(llm, next_logprobs, eos, width, steps):
    params = BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True)
    for prompt, output in zip(PROMPTS, search(llm, params), strict=True):
        expected = reference_beam_search(next_logprobs, prompt, width, steps, eos, ignore_eos=True)
        assert_same_beams(output.sequences, expected)
        assert all(len(s.tokens) == len(prompt) + steps for s in output.sequences)


def test_a_concurrency_limit_gives_the_same_beams(llm):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=5)
    together = search(llm, params)
    one_by_one = search(llm, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [
        [s.tokens for s in o.sequences] for o in one_by_one
    ]


@pytest.mark.parametrize("include_stop", [False, True])
def test_the_served_shape(llm, next_logprobs, eos, include_stop):
    params = BeamSearchParams(
        beam_width=WIDTH, max_tokens=STEPS, include_stop_str_in_output=include_stop
    )
    reasons = set()
    for k, prompt in enumerate(PROMPTS):
        output = llm._complete(
            beam_search_output(
                llm.engine, {"prompt_token_ids": prompt}, params, f"served-{k}", with_logprobs=True
            )
        )
        expected = reference_beam_search(next_logprobs, prompt, WIDTH, STEPS, eos)
        assert output.finished and output.prompt_token_ids == prompt
        assert [o.index for o in output.outputs] == list(range(WIDTH))
        for sample, beam in zip(output.outputs, expected, strict=True):
            generated = beam.tokens[len(prompt) :]
            if beam.finished and not include_stop:
                generated = generated[:-1]  # vLLM drops the EOS from the output
            assert sample.token_ids == generated
            assert sample.cumulative_logprob == pytest.approx(beam.cum_logprob, abs=1e-3)
            assert len(sample.logprobs) == len(generated)
            for token, entries in zip(sample.token_ids, sample.logprobs, strict=True):
                assert token in entries and len(entries) == 2 * WIDTH
            if beam.finished:
                assert (sample.finish_reason, sample.stop_reason) == ("stop", eos)
            else:
                assert (sample.finish_reason, sample.stop_reason) == ("length", None)
            reasons.add(sample.finish_reason)
    assert reasons == {"stop", "length"}


def test_beams_stop_at_the_context(llm, next_logprobs, eos):
    prompt = [(7 * i) % 200 + 3 for i in range(MAX_MODEL_LEN - 3)]
    (output,) = search(llm, BeamSearchParams(beam_width=2, max_tokens=10), [prompt])
    expected = reference_beam_search(next_logprobs, prompt, 2, 3, eos)
    assert_same_beams(output.sequences, expected)


def test_no_step_and_no_block_left_behind(llm):
    (output,) = search(llm, BeamSearchParams(beam_width=4, max_tokens=0), PROMPTS[:1])
    assert [s.tokens for s in output.sequences] == [PROMPTS[0]]  # vLLM's: the prompt alone
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    assert llm.engine.num_unfinished_requests == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"beam_width": 0}, "beam_width must be at least 1, got 0."),
        ({"beam_width": 2.0}, "beam_width must be an int, but is of type <class 'float'>"),
        ({"max_tokens": -1}, "max_tokens must be at least 0, got -1."),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5."),
        ({"length_penalty": "long"}, "length_penalty must be a number, got 'long'."),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1."),
    ],
)
def test_bad_params_are_refused(fields, message):
    with pytest.raises(ValueError) as refused:
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **fields})
    assert str(refused.value) == message


def test_what_beam_search_refuses(llm):
    with pytest.raises(NotImplementedError, match="Embedding prompt not supported"):
        llm.beam_search([{"prompt_embeds": torch.zeros(2, 64)}], BeamSearchParams(2, 2))
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([[1, 2]], {"beam_width": 2, "max_tokens": 2})
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[1, 2]], BeamSearchParams(2, 2), concurrency_limit=0)
    with pytest.raises(ValueError, match="greater than max allowed: 20"):
        llm.beam_search([[1, 2]], BeamSearchParams(11, 2))  # 22 logprobs a step
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
