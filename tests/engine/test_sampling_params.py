"""SamplingParams: vLLM's defaults, normalization and validation messages."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from aioserve.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
)


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.seed, p.logprobs, p.prompt_logprobs) == (
        16,
        0,
        None,
        None,
        None,
    )
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.detokenize, p.skip_special_tokens, p.spaces_between_special_tokens) == (
        True,
        True,
        True,
    )
    assert (p.ignore_eos, p.include_stop_str_in_output) == (False, False)
    assert p.logit_bias is None and p.allowed_token_ids is None
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
        ({"temperature": math.inf}, "temperature must be a finite number, got inf."),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number, got nan."),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0."),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero, got 0.0."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"min_tokens": 5, "max_tokens": 4},
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        ({"logprobs": -1}, "logprobs must be non-negative, got -1."),
        ({"prompt_logprobs": -2}, "prompt_logprobs must be non-negative, got -2."),
        ({"stop": ["ok", ""]}, "stop cannot contain an empty string."),
        ({"stop": ""}, "stop cannot contain an empty string."),
        ({"temperature": 0.0, "n": 2}, "n must be 1 when using greedy sampling, got 2."),
        ({"stop": "x", "detokenize": False}, "stop strings are only supported when detokenize"),
        ({"allowed_token_ids": []}, "allowed_token_ids is not None and empty!"),
    ],
)
def test_rule_violations_name_the_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"temperature": "abc"}, "temperature", "'abc'"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty", "inf"),
        ({"top_p": None}, "top_p", "None"),
        ({"n": 1.5}, "n", "1.5"),
        ({"top_k": "5"}, "top_k", "'5'"),
        ({"max_tokens": True}, "max_tokens", "True"),
        ({"seed": "7"}, "seed", "'7'"),
        ({"seed": 2**63}, "seed", str(2**63)),
        ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
        ({"stop": [1, 2]}, "stop", "[1, 2]"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "[1, '2']"),
        ({"allowed_token_ids": [1, -3]}, "allowed_token_ids", "-3"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias", "'abc'"),
        ({"logit_bias": {"-4": 1.0}}, "logit_bias", "'-4'"),
        ({"logit_bias": {3: "high"}}, "logit_bias", "'high'"),
        ({"output_kind": "delta"}, "output_kind", "'delta'"),
    ],
)
def test_wrong_types_are_value_errors_naming_the_field(kwargs, field, shown):
    with pytest.raises(ValueError) as error:
        SamplingParams(**kwargs)
    assert field in str(error.value) and shown in str(error.value)


def test_accepted_edges():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, presence_penalty=-2.0)
    SamplingParams(top_k=-1, frequency_penalty=2.0, repetition_penalty=1e-3)
    SamplingParams(min_tokens=16, max_tokens=16, logprobs=0, prompt_logprobs=0)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_normalization():
    p = SamplingParams(
        stop="###",
        stop_token_ids=(5, 7, 5),
        logit_bias={"12": 1.5, 3: -200, "7": float("inf")},
        seed=-1,
        logprobs=True,
        max_tokens=32.0,
        temperature=1,
    )
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.logit_bias == {12: 1.5, 3: -100.0, 7: 100.0}
    assert all(type(k) is int for k in p.logit_bias)
    assert p.seed is None
    assert p.logprobs == 1
    assert p.max_tokens == 32 and type(p.max_tokens) is int
    assert p.temperature == 1.0 and type(p.temperature) is float
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_resets_the_random_knobs(temperature):
    p = SamplingParams(temperature=temperature, top_p=0.5, top_k=20, min_p=0.3, seed=3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert p.sampling_type is SamplingType.GREEDY and p.is_greedy


def test_sampling_type():
    assert SamplingParams(temperature=1e-5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=0).sampling_type is SamplingType.RANDOM_SEED
    kept = SamplingParams(temperature=0.7, top_p=0.5, top_k=20, min_p=0.3)
    assert (kept.top_p, kept.top_k, kept.min_p) == (0.5, 20, 0.3)


def test_clone_is_deep_and_replace_validates():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0})
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.logit_bias[2] = 1.0
    assert p.stop == ["x"] and p.logit_bias == {1: 2.0}

    final = p.clone(output_kind=RequestOutputKind.FINAL_ONLY, temperature=0.0)
    assert final.output_kind is RequestOutputKind.FINAL_ONLY and final.is_greedy
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert dataclasses.replace(p, top_k=3).top_k == 3
    assert dataclasses.replace(p, top_k=0).top_k == -1  # vLLM 0.32's "disabled"
    with pytest.raises(ValueError, match="top_k must be 0"):
        dataclasses.replace(p, top_k=-3)
    with pytest.raises(ValueError, match="top_p must be in"):
        p.clone(top_p=2.0)
    assert copy.deepcopy(p) == p


def test_repr_shows_what_differs_and_round_trips():
    assert repr(SamplingParams()) == "SamplingParams()"
    p = SamplingParams(temperature=0.5, stop="x", max_tokens=None)
    assert repr(p) == "SamplingParams(temperature=0.5, stop=['x'], max_tokens=None)"
    namespace = {"SamplingParams": SamplingParams, "RequestOutputKind": RequestOutputKind}
    assert eval(repr(p), namespace) == p


def test_from_dict():
    p = SamplingParams.from_dict(
        {"temperature": 0.3, "top_p": None, "max_tokens": None, "logit_bias": {"5": 1}}
    )
    assert p.temperature == 0.3 and p.top_p == 1.0
    assert p.max_tokens is None
    assert p.logit_bias == {5: 1.0}
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_keys_naming_them():
    with pytest.raises(ValueError) as error:
        SamplingParams.from_dict({"temperature": 0.5, "thinking_budget": 8, "best_of": 2})
    message = str(error.value)
    assert "'thinking_budget'" in message and "'best_of'" in message
    assert "temperature" not in message


def test_from_dict_still_validates():
    with pytest.raises(ValueError, match="n must be at least 1, got 0."):
        SamplingParams.from_dict({"n": 0})


def test_logprob_token_ids_are_checked_as_vllm_checks_them():
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None  # vLLM: not set
    assert SamplingParams(logprob_token_ids=(3, 1)).logprob_token_ids == [3, 1]
    assert SamplingParams(logprobs=2, logprob_token_ids=[3, 1]).wants_logprobs
    with pytest.raises(ValueError, match="greater than max allowed: 128"):
        SamplingParams(logprob_token_ids=list(range(129)))
    with pytest.raises(ValueError, match=r"logprobs must equal len\(logprob_token_ids\)"):
        SamplingParams(logprobs=1, logprob_token_ids=[3, 1])
    with pytest.raises(ValueError, match="logprob_token_ids must be a list of integers"):
        SamplingParams(logprob_token_ids=["a"])
