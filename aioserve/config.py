"""The engine's configuration, built from the argument declarations in `aioserve.arguments`.

Each argument of vLLM's serving surface is one `Argument` there: its name, vLLM's config
group, its default, its help text, how it is spelled on the command line (`kind`) and,
for the arguments aioserve implements, the function that checks and converts its value.
From these declarations come, here, the argparse options (`add_engine_arguments`), the
`--help` text, and the validation shared by the command line (`engine_config_from_args`) and the Python
API (`engine_config_from_kwargs`, behind `LLM(**kwargs)`). The HTTP server's own arguments
(vLLM's Frontend group) are not part of the EngineConfig: `frontend_options_from_args` gives
them to the server as a plain mapping.

Arguments aioserve does not implement yet are still declared, so that the parser knows
them: setting one (on the command line, in a `--config` file, or as a keyword) is refused
at start-up with a message naming it. Setting it to vLLM's default is refused as well;
only untouched arguments are harmless.

The command line parses every engine argument to a plain string (or a list, a bool, or a
decoded JSON value); conversion and checks happen afterwards, in the same functions the
keyword path uses, so both paths give the same error for the same bad value. Errors are
`ConfigError`s whose message names the flag (`--max-num-seqs must be at least 1, got 0`)
or, for keywords, the keyword (`max_num_seqs must be ...`).

The engine resolves some fields later; None there means "the engine decides":
block_size (16), max_model_len (from the model), max_num_seqs (256),
max_num_batched_tokens, enable_prefix_caching (on), enable_chunked_prefill (on) and
async_scheduling (on for a GPU, off for the CPU).

Besides arguments, the CPU KV-cache size comes from vLLM's environment variable
VLLM_CPU_KVCACHE_SPACE (GiB, default 4), resolved into `CacheConfig.cpu_kvcache_space_bytes`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aioserve.arguments import (
    ARGUMENTS,
    CPU_KVCACHE_SPACE_ENV,
    DEFAULT_CPU_KVCACHE_SPACE_GIB,
    FRONTEND,
    GROUP_DESCRIPTIONS,
    Argument,
    ConfigError,
    argument,
)

# ---------------------------------------------------------------------------------------
# The configuration objects.
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str  # the model when --tokenizer is not given
    tokenizer_mode: str
    trust_remote_code: bool
    dtype: str
    seed: int
    max_model_len: int | None
    quantization: str | None
    enforce_eager: bool
    max_logprobs: int
    generation_config: str
    override_generation_config: dict[str, Any]
    hf_overrides: dict[str, Any]
    served_model_name: list[str] | None
    skip_tokenizer_init: bool


@dataclass(frozen=True)
class LoadConfig:
    load_format: str
    download_dir: str | None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int | None
    gpu_memory_utilization: float
    num_gpu_blocks_override: int | None
    enable_prefix_caching: bool | None
    cpu_kvcache_space_bytes: int  # from VLLM_CPU_KVCACHE_SPACE


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enable_chunked_prefill: bool | None
    scheduling_policy: str
    async_scheduling: bool | None
    max_num_queued_reqs: int | None  # None: no limit (load_shedding.py)
    max_num_queued_tokens: int | None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    load: LoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig


# ---------------------------------------------------------------------------------------
# argparse.
# ---------------------------------------------------------------------------------------


class JsonArgumentAction(argparse.Action):
    """Stores the decoded JSON value of a JSON argument.

    The dotted form (`--hf-overrides.a.b 1`) is expanded by aioserve.cli's parser, which
    finds the JSON arguments through this class.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = json.loads(values)
        except json.JSONDecodeError as error:
            raise argparse.ArgumentError(self, f"not valid JSON: {values!r} ({error})") from None
        setattr(namespace, self.dest, value)


UNSUPPORTED_GROUP_TITLE = "vLLM arguments that aioserve does not support yet"


def _help(argument: Argument) -> str:
    if argument.supported:
        text = argument.help
        if argument.kind != "bool" or argument.default is not None:
            if argument.default not in (None, {}):
                text += f" (default: {argument.default})"
    else:
        text = f"[{argument.group}, not supported yet] {argument.help}"
    return text.replace("%", "%%")  # argparse formats help strings with %


def _metavar(argument: Argument) -> str | None:
    if argument.choices:
        return "{" + ",".join(str(choice) for choice in argument.choices) + "}"
    if argument.kind == "json":
        return "JSON"
    return None


def add_engine_arguments(parser: argparse.ArgumentParser, *, frontend: bool = True) -> None:
    """Add every declared vLLM argument to `parser`.

    Supported arguments go in one group per vLLM config group; the others in a final group
    titled UNSUPPORTED_GROUP_TITLE. No argument gets a default in the namespace: an
    attribute is present only when the user set it, which is how unsupported arguments are
    detected. `engine_config_from_args` fills in the defaults. With `frontend=False` the
    HTTP-server arguments are left out (for `bench`, which has no server).
    """
    declared = [a for a in ARGUMENTS if frontend or a.group != FRONTEND]
    groups: dict[str, Any] = {}
    for group in dict.fromkeys(a.group for a in declared if a.supported):
        groups[group] = parser.add_argument_group(group, GROUP_DESCRIPTIONS[group])
    unsupported = parser.add_argument_group(
        UNSUPPORTED_GROUP_TITLE,
        "aioserve knows these vLLM arguments and refuses to start when one is set.",
    )
    for arg in declared:
        target = groups[arg.group] if arg.supported else unsupported
        options: dict[str, Any] = {
            "dest": arg.dest,
            "default": argparse.SUPPRESS,
            "help": _help(arg),
        }
        if arg.kind == "flag":
            options["action"] = "store_true"
        elif arg.kind == "bool":
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["metavar"] = _metavar(arg)
            if arg.kind == "json":
                options["action"] = JsonArgumentAction
            elif arg.kind == "list":
                options["nargs"] = "+"
            elif arg.kind == "append":
                options["action"] = "append"
            elif arg.kind == "optional":
                options["nargs"] = "?"
                options["const"] = True
        target.add_argument(arg.flag, *arg.aliases, **options)


# ---------------------------------------------------------------------------------------
# Building the configuration.
# ---------------------------------------------------------------------------------------


def _convert(arg: Argument, value: Any, label: str) -> Any:
    """Check and convert one supported argument's value; `label` names it in errors."""
    if value is None and arg.default is None:
        return None
    try:
        result = arg.convert(value)
    except ValueError as error:
        raise ConfigError(f"{label} {error}") from None
    if arg.choices and result not in arg.choices:
        accepted = ", ".join(str(choice) for choice in arg.choices)
        if result in arg.vllm_choices:
            raise ConfigError(
                f"{arg.choice_noun} {result!r} is not supported by aioserve yet "
                f"({label} accepts {accepted})"
            )
        raise ConfigError(f"{label} must be one of {accepted}; got {result!r}")
    return result


def cpu_kvcache_space_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The CPU KV-cache size that VLLM_CPU_KVCACHE_SPACE asks for (GiB, default 4)."""
    environ = os.environ if environ is None else environ
    raw = environ.get(CPU_KVCACHE_SPACE_ENV)
    if raw is None:
        return int(DEFAULT_CPU_KVCACHE_SPACE_GIB * 2**30)
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise ConfigError(f"{CPU_KVCACHE_SPACE_ENV} must be a positive number of GiB, got {raw!r}")
    return int(gib * 2**30)


def _refuse_unsupported(names: list[str]) -> None:
    if names:
        verb = "is a vLLM argument" if len(names) == 1 else "are vLLM arguments"
        raise ConfigError(f"{', '.join(names)} {verb} that aioserve does not support yet")


def _build(values: dict[str, Any]) -> EngineConfig:
    """The EngineConfig from already converted values (dest -> value) of the set arguments."""
    fields = {
        a.dest: values[a.dest] if a.dest in values else copy.deepcopy(a.default)
        for a in ARGUMENTS
        if a.supported
    }
    if fields["tokenizer"] is None:
        fields["tokenizer"] = fields["model"]
    fields["cpu_kvcache_space_bytes"] = cpu_kvcache_space_bytes()

    def section(cls):
        return cls(**{field.name: fields[field.name] for field in dataclasses.fields(cls)})

    return EngineConfig(
        model=section(ModelConfig),
        load=section(LoadConfig),
        cache=section(CacheConfig),
        scheduler=section(SchedulerConfig),
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig from a namespace parsed by a parser set up by `add_engine_arguments`.

    Raises ConfigError when an unsupported vLLM argument was set or a value is invalid.
    Attributes that are not engine arguments (the subcommand, `--config`, ...) are ignored.
    """
    given = [(a, getattr(args, a.dest)) for a in ARGUMENTS if hasattr(args, a.dest)]
    _refuse_unsupported([a.spelling for a, _ in given if not a.supported])
    values = {a.dest: _convert(a, value, a.flag) for a, value in given}
    return _build(values)


def frontend_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The HTTP server's options: every supported Frontend argument's dest -> its value.

    Values given on the command line (or in `--config`) are checked and converted as in
    `engine_config_from_args`; the others take their declared default. Raises ConfigError
    for an invalid value. Unsupported Frontend arguments are refused by
    `engine_config_from_args`, which a command calls first.
    """
    return {
        a.dest: _convert(a, getattr(args, a.dest), a.flag)
        if hasattr(args, a.dest)
        else copy.deepcopy(a.default)
        for a in ARGUMENTS
        if a.group == FRONTEND and a.supported
    }


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """The EngineConfig from LLM(**kwargs)-style snake_case keywords.

    Values may be Python values (max_model_len=2048) or the command line's text ("2k").
    Raises TypeError for names that are not engine arguments and ConfigError (a ValueError)
    for vLLM arguments aioserve does not support yet and for invalid values.
    """
    declared = {name: argument(name) for name in kwargs}
    unknown = [name for name, arg in declared.items() if arg is None or not arg.is_keyword]
    if unknown:
        raise TypeError(f"unexpected engine argument(s): {', '.join(unknown)}")
    _refuse_unsupported([name for name, arg in declared.items() if not arg.supported])
    return _build({name: _convert(declared[name], value, name) for name, value in kwargs.items()})
