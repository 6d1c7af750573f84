"""--speculative-config (vLLM's JSON of speculative-decoding settings): the n-gram forms it
takes and the defaults it fills in as vLLM does, every refusal naming the flag (or the
LLM(...) keyword), and the settings it cannot be combined with: --async-scheduling and a
pooling model.

The end-to-end behaviour of a server that speculates is tests/server/
test_speculative_serving.py's.
"""

from __future__ import annotations

import argparse
import json

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_args, engine_config_from_kwargs
from aioserve.config.parser import UNSUPPORTED_GROUP_TITLE, add_engine_arguments
from aioserve.config.speculative import NgramSpeculation
from aioserve.engine.build import build_engine
from aioserve.engine.resolution import resolve_async_scheduling

FLAG = "--speculative-config"


@pytest.fixture(autouse=True)
def _default_kvcache_env(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test", allow_abbrev=False)
    add_engine_arguments(parser)
    return parser


def _speculation(*argv: str) -> NgramSpeculation | None:
    config = engine_config_from_args(_parser().parse_args(list(argv)))
    return config.speculative.speculative_config


def _flag(settings: dict) -> list[str]:
    return [FLAG, json.dumps(settings)]


# --- accepted forms --------------------------------------------------------------------------

ACCEPTED = [
    # vLLM's documented example.
    (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5, "prompt_lookup_min": 2},
        NgramSpeculation(4, 2, 5),
    ),
    # Neither bound: both 5, vLLM's default.
    ({"method": "ngram", "num_speculative_tokens": 3}, NgramSpeculation(3, 5, 5)),
    # Only the maximum: the minimum is the same (vLLM).
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, NgramSpeculation(2, 3, 3)),
    # Only the minimum: the maximum is the same (vLLM).
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 7}, NgramSpeculation(2, 7, 7)),
    # vLLM's older spellings: "[ngram]", or the method named as the model.
    ({"method": "[ngram]", "num_speculative_tokens": 4}, NgramSpeculation(4, 5, 5)),
    ({"model": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3}, NgramSpeculation(4, 3, 3)),
    ({"model": "[ngram]", "num_speculative_tokens": 1}, NgramSpeculation(1, 5, 5)),
    ({"method": "ngram", "model": "ngram", "num_speculative_tokens": 5}, NgramSpeculation(5, 5, 5)),
    # The smallest values.
    (
        {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1, "prompt_lookup_max": 1},
        NgramSpeculation(1, 1, 1),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "expected"), ACCEPTED)
def test_ngram_forms_are_taken_with_vllms_defaults(settings, expected):
    value = _speculation(*_flag(settings))
    assert type(value) is NgramSpeculation
    assert value == expected


def test_no_flag_means_no_speculation():
    assert _speculation() is None
    assert engine_config_from_kwargs().speculative.speculative_config is None
    assert _speculation(FLAG, "null") is None


def test_the_accepted_value_describes_itself_for_the_start_up_log():
    value = _speculation(*_flag(ACCEPTED[0][0]))
    assert value.describe() == "n-gram lookup, 4 drafts a step, n-grams of 2-5 tokens"


# --- refusals --------------------------------------------------------------------------------

REFUSED = [
    ({"method": "eagle", "num_speculative_tokens": 4}, "method 'eagle' is a vLLM method that aioserve does not support yet; aioserve runs \"ngram\""),
    ({"method": "eagle3", "num_speculative_tokens": 4}, "method 'eagle3' is a vLLM method that aioserve does not support yet"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "method 'draft_model' is a vLLM method that aioserve does not support yet"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "method 'mtp' is a vLLM method that aioserve does not support yet"),
    ({"method": "suffix", "num_speculative_tokens": 4}, "method 'suffix' is a vLLM method that aioserve does not support yet"),
    ({"method": "lookahead", "num_speculative_tokens": 4}, "method 'lookahead' is not a method aioserve knows"),
    # A draft model named alone (vLLM's draft-model form) is not a method aioserve runs.
    ({"model": "meta-llama/Llama-3.2-1B", "num_speculative_tokens": 4}, "model 'meta-llama/Llama-3.2-1B': aioserve runs the method \"ngram\" only, which uses no draft model"),
    ({"method": "ngram", "model": "meta-llama/Llama-3.2-1B", "num_speculative_tokens": 4}, "model 'meta-llama/Llama-3.2-1B': aioserve runs the method \"ngram\" only"),
    ({"num_speculative_tokens": 4}, 'needs a "method"; aioserve runs "ngram"'),
    ({}, 'needs a "method"'),
    ({"method": "ngram", "num_speculative_tokens": 4, "foo": 1}, "key 'foo' is not supported by aioserve (it takes method, model, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)"),
    # Keys of vLLM's SpeculativeConfig that the n-gram method here does not take.
    ({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}, "key 'disable_by_batch_size' is not supported by aioserve"),
    ({"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}, "key 'draft_tensor_parallel_size' is not supported by aioserve"),
    ({"method": "ngram"}, "needs num_speculative_tokens (the drafts a step)"),
    ({"method": "ngram", "num_speculative_tokens": None}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "key 'num_speculative_tokens' must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": -2}, "key 'num_speculative_tokens' must be a positive integer, got -2"),
    ({"method": "ngram", "num_speculative_tokens": True}, "key 'num_speculative_tokens' must be a positive integer, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "key 'num_speculative_tokens' must be a positive integer, got 2.5"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "key 'num_speculative_tokens' must be a positive integer, got '4'"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}, "key 'prompt_lookup_min' must be a positive integer, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": -1}, "key 'prompt_lookup_max' must be a positive integer, got -1"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": False}, "key 'prompt_lookup_max' must be a positive integer, got False"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be at least 1 and at most prompt_lookup_max=2"),
]  # fmt: skip


@pytest.mark.parametrize(("settings", "message"), REFUSED)
def test_refusals_name_the_flag_and_the_problem(settings, message):
    with pytest.raises(ConfigError) as error:
        _speculation(*_flag(settings))
    text = str(error.value)
    assert text.startswith(f"{FLAG} "), text
    assert message in text
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize("text", ["[1]", '"ngram"', "4"])
def test_a_value_that_is_not_a_json_object_is_refused(text):
    with pytest.raises(ConfigError, match=f"^{FLAG} must be a JSON object"):
        _speculation(FLAG, text)


def test_text_that_is_not_json_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args([FLAG, "{method: ngram}"])
    assert exit_info.value.code == 2
    assert f"argument {FLAG}/-sc: not valid JSON" in capsys.readouterr().err


def test_a_refusal_is_reported_with_the_other_problems_of_the_command_line():
    with pytest.raises(ConfigError) as error:
        _speculation(
            "--max-num-seqs", "0", *_flag({"method": "eagle", "num_speculative_tokens": 1})
        )
    message = str(error.value)
    assert "--max-num-seqs must be at least 1, got 0" in message
    assert f"{FLAG} method 'eagle'" in message


def test_the_dataclass_checks_its_own_values():
    with pytest.raises(ValueError, match="num_speculative_tokens must be at least 1"):
        NgramSpeculation(0)
    with pytest.raises(ValueError, match="prompt_lookup_min=3 must be at least 1 and at most"):
        NgramSpeculation(2, 3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min=0"):
        NgramSpeculation(2, 0, 2)


# --- LLM(...) keywords -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
        NgramSpeculation(3, 4, 4),
    ],
    ids=["dict", "json-text", "dataclass"],
)
def test_llm_keyword_takes_a_dict_json_text_or_the_dataclass(value):
    config = engine_config_from_kwargs(speculative_config=value)
    assert config.speculative.speculative_config == NgramSpeculation(3, 4, 4)


def test_llm_keyword_refusals_name_the_keyword():
    with pytest.raises(ConfigError) as error:
        engine_config_from_kwargs(
            speculative_config={"method": "eagle", "num_speculative_tokens": 2}
        )
    assert str(error.value).startswith("speculative_config method 'eagle' is a vLLM method")
    with pytest.raises(ConfigError, match="^speculative_config needs num_speculative_tokens"):
        engine_config_from_kwargs(speculative_config={"method": "ngram"})


def test_vllms_other_speculative_keywords_are_still_refused_by_name():
    with pytest.raises(ConfigError, match="is a vLLM argument that aioserve does not support yet"):
        engine_config_from_kwargs(num_speculative_tokens=4)


# --- help --------------------------------------------------------------------------------------


def test_help_lists_the_flag_among_the_supported_ones():
    text = _parser().format_help()
    unsupported = text.index(f"\n{UNSUPPORTED_GROUP_TITLE}:")
    assert -1 < text.index(FLAG) < unsupported
    assert FLAG not in text[unsupported:]
    assert "--num-speculative-tokens" in text[unsupported:]


# --- what it cannot be combined with -----------------------------------------------------------


def test_async_scheduling_with_speculation_is_refused_naming_both():
    with pytest.raises(ConfigError) as error:
        _speculation("--async-scheduling", *_flag({"method": "ngram", "num_speculative_tokens": 2}))
    message = str(error.value)
    assert "--async-scheduling" in message and FLAG in message
    # Either alone is taken.
    assert _speculation(*_flag({"method": "ngram", "num_speculative_tokens": 2})) is not None
    assert _speculation("--async-scheduling") is None


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_speculation_turns_asynchronous_scheduling_off(platform):
    assert resolve_async_scheduling(None, platform, speculating=True) is False
    assert resolve_async_scheduling(False, platform, speculating=True) is False
    # The same settings without speculation: asked for, or the platform's default.
    assert resolve_async_scheduling(True, platform) is True
    assert resolve_async_scheduling(None, platform) is (platform == "cuda")


def test_a_pooling_model_is_refused(minilm_folder):
    config = engine_config_from_kwargs(
        model=str(minilm_folder),
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    with pytest.raises(ValueError, match=f"^{FLAG}: a pooling model samples no tokens to draft"):
        build_engine(config)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "--spec-tokens",
                "3",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ],
            r"--spec-tokens and --speculative-config\['num_speculative_tokens'\] are mutually exclusive",
        ),
        (["--spec-method", "ngram"], r"--spec-method needs num_speculative_tokens"),
        (["--spec-tokens", "2"], r'--spec-tokens needs a "method"'),
        (
            ["--spec-method", "eagle3", "--spec-tokens", "2"],
            "speculative method 'eagle3' is not supported by aioserve yet",
        ),
        (
            ["--spec-model", "org/draft", "--spec-tokens", "2"],
            "--spec-model 'org/draft': aioserve runs the method \"ngram\" only",
        ),
        (["--spec-tokens", "0", "--spec-method", "ngram"], "--spec-tokens must be at least 1"),
        (
            ["--speculative-config", '{"prompt_lookup_max": 3}', "--spec-tokens", "2"],
            r'--speculative-config and --spec-tokens needs a "method"',
        ),
    ],
)
def test_vllm_032_shorthands_are_refused_as_vllm_refuses_them(argv, message):
    """vLLM 0.32's --spec-method, --spec-model and --spec-tokens each set one key of
    --speculative-config; a key set both ways is vLLM's error."""
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(_parser().parse_args(argv))


def test_vllm_032_shorthands_as_keywords():
    config = engine_config_from_kwargs(spec_method="ngram", spec_tokens=3)
    assert config.speculative.speculative_config == NgramSpeculation(3, 5, 5)
