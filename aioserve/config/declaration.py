"""What an argument declaration is: `Argument`, vLLM's config groups, platform defaults.

The declarations themselves are in `aioserve.config.arguments`; this module holds their
type, so that the parser (`parser.py`) and the configuration builders (`engine.py`,
`frontend.py`) read one description of each argument.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value that aioserve cannot accept; the message names the argument."""


FRONTEND = "Frontend"
MODEL = "ModelConfig"
LOAD = "LoadConfig"
DECODING = "DecodingConfig"
PARALLEL = "ParallelConfig"
CACHE = "CacheConfig"
MULTIMODAL = "MultiModalConfig"
LORA = "LoRAConfig"
PROMPT_ADAPTER = "PromptAdapterConfig"
SPECULATIVE = "SpeculativeConfig"
OBSERVABILITY = "ObservabilityConfig"
SCHEDULER = "SchedulerConfig"
VLLM = "VllmConfig"
TOKENIZER_POOL = "TokenizerPoolConfig"
DEVICE = "DeviceConfig"
ATTENTION = "AttentionConfig"
KERNEL = "KernelConfig"
MAMBA = "MambaConfig"
OFFLOAD = "OffloadConfig"
LOGGING = "LoggingConfig"

GROUP_DESCRIPTIONS: dict[str, str] = {
    FRONTEND: "The HTTP server: address, TLS, CORS, authentication, logging, tools.",
    MODEL: "Which model to serve and how to run it.",
    LOAD: "Where and how the model weights are loaded.",
    DECODING: "Structured outputs and reasoning parsers.",
    PARALLEL: "Tensor, pipeline, data and expert parallelism.",
    CACHE: "The paged KV cache and prefix caching.",
    MULTIMODAL: "Image, video and audio inputs.",
    LORA: "LoRA adapters.",
    PROMPT_ADAPTER: "Prompt adapters (soft prompts).",
    SPECULATIVE: "Speculative decoding.",
    OBSERVABILITY: "Tracing and hidden metrics.",
    SCHEDULER: "Continuous batching: how many sequences and tokens run per step.",
    VLLM: "Compilation and cross-instance settings.",
    TOKENIZER_POOL: "The asynchronous tokenizer pool (deprecated in vLLM).",
    DEVICE: "The execution device (deprecated in vLLM; detected from the platform).",
    ATTENTION: "Attention kernels.",
    KERNEL: "Kernel backends of linear, MoE and other layers.",
    MAMBA: "Mamba and other state-space layers.",
    OFFLOAD: "Weights kept in host memory and streamed to the device.",
    LOGGING: "vLLM's loggers.",
}

# How an argument is spelled on the command line:
#   value     one value:                      --port 8000
#   flag      present or absent:              --allow-credentials
#   bool      a switch with a negation:       --enforce-eager / --no-enforce-eager
#   json      JSON, or its keys one by one:   --hf-overrides '{"a": 1}' / --hf-overrides.a 1
#   list      one or more values:             --served-model-name a b
#   append    repeated, one value each time:  --middleware m1 --middleware m2
#   optional  a value, or the bare flag:      --hf-token / --hf-token TOKEN
Kind = Literal["value", "flag", "bool", "json", "list", "append", "optional"]


@dataclass(frozen=True)
class PlatformDefault:
    """A default that depends on the device: one value on the CPU, another on a GPU; and,
    where vLLM's own does, on the use: `cpu_server` for `serve` on the CPU (vLLM's
    OPENAI_API_SERVER usage context), `cpu` for the offline engine and benchmarks (its
    LLM_CLASS context).

    The configuration keeps None for such an argument when it is not given (config
    building does not import torch, so it does not know the device); the engine picks
    `on(platform, serving)` once it does (engine/build.py).
    """

    cpu: Any
    gpu: Any
    cpu_server: Any = None  # None: `cpu` for the server too

    def on(self, platform: str, serving: bool = False) -> Any:
        """The value on `platform` ("cpu", "cuda" or "rocm"), for the server or not."""
        if platform != "cpu":
            return self.gpu
        return self.cpu_server if serving and self.cpu_server is not None else self.cpu

    def __str__(self) -> str:
        if self.cpu_server is None:
            return f"{self.cpu} on the CPU, {self.gpu} on a GPU"
        return (
            f"{self.cpu_server} for `serve` on the CPU ({self.cpu} for the offline "
            f"benchmarks), {self.gpu} on a GPU"
        )


@dataclass(frozen=True)
class Argument:
    """One vLLM argument.

    An argument aioserve implements has a `convert` function (raw value -> typed value,
    raising ValueError). The others are declared so that they are recognised, shown in
    `--help`, and refused by name when set.
    """

    name: str  # the long option without its leading dashes: "max-model-len"
    group: str  # vLLM's config group: "ModelConfig"
    default: Any  # the value when not set (vLLM's if unsupported); may be a PlatformDefault
    help: str
    kind: Kind = "value"
    convert: Callable[[Any], Any] | None = None
    choices: tuple[Any, ...] = ()  # the accepted values, when they form a closed list
    vllm_choices: tuple[Any, ...] = ()  # vLLM values aioserve refuses by name
    choice_noun: str = ""  # what one value is called: "quantization method"
    aliases: tuple[str, ...] = ()  # other spellings: ("-tp",)
    keyword: bool | None = None  # accepted by LLM(**kwargs); default: not a Frontend one
    metavar: str | None = None  # how --help shows the value, where choices do not say it
    why: str = ""  # an unsupported argument's refusal, where "not yet" is not the reason

    @property
    def supported(self) -> bool:
        return self.convert is not None

    @property
    def dest(self) -> str:
        """The snake_case name: the namespace attribute, the keyword and the field name."""
        return self.name.replace("-", "_")

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def spelling(self) -> str:
        """The flag and its aliases, as error messages show them: "--tensor-parallel-size (-tp)"."""
        return f"{self.flag} ({', '.join(self.aliases)})" if self.aliases else self.flag

    @property
    def is_keyword(self) -> bool:
        return self.keyword if self.keyword is not None else self.group != FRONTEND

    @property
    def unset_value(self) -> Any:
        """The configuration's value when the argument is not set: None for a platform default."""
        return None if isinstance(self.default, PlatformDefault) else self.default

    def check(self, value: Any, label: str) -> Any:
        """`value` converted and checked; a ConfigError naming `label` when it is refused.

        None means "not set" (a keyword may pass it) and gives the unset value.
        """
        if value is None:
            return copy.deepcopy(self.unset_value)
        try:
            result = self.convert(value)
        except ValueError as error:
            raise ConfigError(f"{label} {error}") from None
        if self.choices and result not in self.choices:
            accepted = ", ".join('"" (none)' if c == "" else str(c) for c in self.choices)
            if result in self.vllm_choices:
                raise ConfigError(
                    f"{self.choice_noun} {result!r} is not supported by aioserve yet "
                    f"({label} accepts {accepted})"
                )
            raise ConfigError(f"{label} must be one of {accepted}; got {result!r}")
        return result


def checked_values(
    given: Iterable[tuple[Argument, Any]], *, keywords: bool = False
) -> dict[str, Any]:
    """dest -> checked value for each (argument, raw value) given.

    Errors name the flag (`--tensor-parallel-size (-tp)` for an unsupported argument), or
    the keyword with `keywords=True`. Every problem is reported in one ConfigError, so that
    a command line with several unsupported arguments or values is fixed in one go: first
    the unsupported arguments (those refused for a reason of their own, `why`, each with
    it), then each refused value.
    """
    given = list(given)
    refused = [a for a, _ in given if not a.supported]
    unsupported = [a.dest if keywords else a.spelling for a in refused if not a.why]
    problems = []
    if unsupported:
        verb = "is a vLLM argument" if len(unsupported) == 1 else "are vLLM arguments"
        problems.append(f"{', '.join(unsupported)} {verb} that aioserve does not support yet")
    problems += [f"{a.dest if keywords else a.spelling} {a.why}" for a in refused if a.why]
    checked = {}
    for argument, value in given:
        if argument.supported:
            try:
                checked[argument.dest] = argument.check(
                    value, argument.dest if keywords else argument.flag
                )
            except ConfigError as error:
                problems.append(str(error))
    if problems:
        raise ConfigError("; ".join(problems))
    return checked


def vllm_only(
    name: str, group: str, default: Any, help: str, kind: Kind = "value", **more: Any
) -> Argument:
    """A vLLM argument that aioserve recognises but does not implement yet (no `convert`:
    refused by name when set)."""
    return Argument(name, group, default, help, kind, **more)
