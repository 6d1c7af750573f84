"""The value converters of the argument declarations (aioserve.config.arguments).

Each takes a raw value (a string from the command line, or a Python value from a keyword
argument) and returns the typed value, or raises ValueError with a message that reads well
after the argument's name: "must be at least 1, got 0".
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any


def string(value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"must be a non-empty string, got {value!r}")
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def integer(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        return int(value)
    raise ValueError(f"must be an integer, got {value!r}")


def integer_at_least(minimum: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        number = integer(value)
        if number < minimum:
            raise ValueError(f"must be at least {minimum}, got {number}")
        return number

    return convert


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


AUTO_FIT = -1
"""--max-model-len -1 or auto (vLLM's): the model's context, cut to what the KV cache holds."""


def context_length(value: Any) -> int:
    """--max-model-len: a token count (`token_count`), or -1 / "auto" for AUTO_FIT."""
    if value == AUTO_FIT or (isinstance(value, str) and value.strip().lower() in ("-1", "auto")):
        return AUTO_FIT
    return token_count(value)


def token_count(value: Any) -> int:
    """A positive token count, also in vLLM's human-readable forms (`human_readable`)."""
    return human_readable(value, "tokens")


def byte_count(value: Any) -> int:
    """A positive number of bytes, also in vLLM's human-readable forms: 4G, 512M, 1.5g."""
    return human_readable(value, "bytes")


def human_readable(value: Any, unit: str) -> int:
    """A positive whole number of `unit`, as vLLM's human_readable_int reads it.

    Lower-case suffixes are powers of ten and take decimals ("25.6k" = 25600); upper-case
    ones are powers of two and take whole numbers only ("1K" = 1024).
    """
    if isinstance(value, str):
        match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", value.strip())
        if match:
            number, suffix = match.groups()
            if suffix in _BINARY_SUFFIXES and "." in number:
                raise ValueError(
                    f"takes whole numbers with the binary suffix {suffix!r}, got {value!r} "
                    f"(did you mean {number}{suffix.lower()}?)"
                )
            count = Decimal(number) * (_DECIMAL_SUFFIXES | _BINARY_SUFFIXES)[suffix]
            if count != count.to_integral_value():
                raise ValueError(f"must be a whole number of {unit}, got {value!r}")
            value = int(count)
        elif not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise ValueError(
                f"must be an integer, optionally with a k/m/g (powers of 10) or K/M/G "
                f"(powers of 2) suffix such as 4k or 32K, got {value!r}"
            )
    return integer_at_least(1)(value)


def fraction(value: Any) -> float:
    """A number in (0, 1]."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not 0.0 < number <= 1.0:
        raise ValueError(f"must be a number greater than 0 and at most 1, got {value!r}")
    return number


def positive_number(value: Any) -> float:
    """A finite number greater than 0."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"must be a number greater than 0, got {value!r}")
    return number


def non_negative_number(value: Any) -> float:
    """A finite number, 0 or more."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"must be a number at least 0, got {value!r}")
    return number


DETAILED_TRACE_MODULES = ("model", "worker", "all")


def detailed_trace_modules(value: Any) -> list[str]:
    """--collect-detailed-traces: one or more of model, worker, all, as a list or separated
    by commas ("model,worker", vLLM's spelling); repeats dropped, the order kept."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError(f"must be one or more of model, worker, all, got {value!r}")
    modules = [m.strip() for item in items for m in item.split(",")]
    wrong = [m for m in modules if m not in DETAILED_TRACE_MODULES]
    if wrong or not modules:
        raise ValueError(
            f"must be one or more of model, worker, all (a list, or separated by commas), "
            f"got {value!r}"
        )
    return list(dict.fromkeys(modules))


def json_object(value: Any) -> dict[str, Any]:
    """A JSON object, given as a dict or as JSON text; the result is a private copy."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"must be a JSON object, got {value!r} ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, got {value!r}")
    return copy.deepcopy(value)


# vLLM 0.32's histogram bucket families (v1/metrics/buckets.py).
HISTOGRAM_FAMILIES = (
    "request_latency",
    "time_to_first_token",
    "inter_token_latency",
    "iteration_tokens",
    "request_params_n",
    "request_num_preemptions",
    "request_tokens",
    "kv_cache_residency",
)


def histogram_buckets(value: Any) -> dict[str, list[float]]:
    """--custom-histogram-buckets: family -> strictly increasing, positive, finite bounds,
    checked as vLLM 0.32 checks them (its messages)."""
    families = json_object(value)
    checked = {}
    for family, bounds in families.items():
        if family not in HISTOGRAM_FAMILIES:
            known = sorted(HISTOGRAM_FAMILIES)
            raise ValueError(f"unknown bucket family {family!r}; known families: {known}")
        if not isinstance(bounds, list) or not bounds:
            raise ValueError(f"[{family!r}]: bucket list must be a non-empty list of numbers")
        for bound in bounds:
            if isinstance(bound, bool) or not isinstance(bound, (int, float)):
                raise ValueError(f"[{family!r}]: bound {bound!r} must be a number")
            if not math.isfinite(bound) or bound <= 0:
                raise ValueError(f"[{family!r}]: bound {bound!r} must be finite and greater than 0")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"[{family!r}]: bounds {bounds} must be strictly increasing")
        checked[family] = [float(bound) for bound in bounds]
    return checked


def names(value: Any) -> list[str]:
    """One name or several (the command line gives a list, a keyword may give a string)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names:
        raise ValueError(f"must be one or more names, got {value!r}")
    if not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"must be non-empty strings, got {value!r}")
    return list(names)


def logits_processors(value: Any) -> tuple[Any, ...]:
    """Logits-processor classes: 'module.path:ClassName' names (imported by the engine) or,
    from Python, the classes themselves."""
    entries = [value] if isinstance(value, (str, type)) else value
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"must be one or more 'module:Class' names, got {value!r}")
    for entry in entries:
        if isinstance(entry, type):
            continue
        if not isinstance(entry, str) or entry.count(":") != 1 or not all(entry.split(":")):
            raise ValueError(f"{entry!r} is not '<module>:<class>' (e.g. my_pkg.procs:MyProcessor)")
    return tuple(entries)


def positive_integers(value: Any) -> list[int]:
    """One positive integer or several (the command line gives a list of strings)."""
    numbers = [value] if isinstance(value, (int, str)) else value
    if not isinstance(numbers, (list, tuple)):
        raise ValueError(f"must be one or more positive integers, got {value!r}")
    return [integer_at_least(1)(number) for number in numbers]


def generation_config(value: Any) -> str:
    text = string(value)
    if text not in ("auto", "vllm") and not os.path.isdir(text):
        raise ValueError(f"must be 'auto', 'vllm' or an existing folder, got {text!r}")
    return text


def port(value: Any) -> int:
    number = integer(value)
    if not 0 <= number <= 65535:
        raise ValueError(f"must be a TCP port from 0 to 65535, got {number}")
    return number


def seconds(value: Any) -> float:
    """A non-negative number of seconds."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"must be a number of seconds, 0 or more, got {value!r}")
    return number


def one_process(what: str) -> Callable[[Any], int]:
    """A parallel size that aioserve honours only at 1 (vLLM's default): the model runs on
    one device, in the server's own process. `what` names the parallelism for the error."""

    def convert(value: Any) -> int:
        size = integer(value)
        if size != 1:
            raise ValueError(
                f"{size}: {what} is not supported by aioserve yet (the model runs on one "
                "device, in the server's own process); only 1 is accepted"
            )
        return size

    return convert


CASCADE_ATTENTION_DEPRECATION = (
    "--disable-cascade-attn is deprecated and has no effect since cascade "
    "attention has been removed. It will be removed in v0.33.0."
)  # vLLM 0.32's words, logged when the flag is given


def cascade_attention_off(value: Any) -> bool:
    """--disable-cascade-attn: true only (vLLM 0.32's default). aioserve has no cascade
    attention (vLLM's FlashAttention path for a prefix shared by a whole batch) to turn on."""
    if not boolean(value):
        raise ValueError(
            "false asks for cascade attention, which aioserve does not have: its attention "
            "reads every sequence's blocks on their own (true, the default, is accepted)"
        )
    return True


def tokens_only(value: Any) -> bool:
    """--tokens-only: vLLM 0.32's dedicated Tokens In<>Out mode. True also skips loading the
    tokenizer (engine.py sets skip_tokenizer_init, as vLLM's create_engine_config does) and
    serves the scale-out routes without --enable-scale-out (server/scale_out.py), where
    /inference/v1/generate never detokenizes (server/generate_tokens.py)."""
    return boolean(value)


def json_names(value: Any) -> list[str]:
    """A list of strings, given as a list or as JSON text: '["GET", "POST"]'."""
    names = value
    if isinstance(value, str):
        try:
            names = json.loads(value)
        except json.JSONDecodeError:
            names = None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise ValueError(f'must be a JSON list of strings such as ["a", "b"], got {value!r}')
    return list(names)


_CERT_REQS = {"CERT_NONE": 0, "CERT_OPTIONAL": 1, "CERT_REQUIRED": 2}


def cert_reqs(value: Any) -> int:
    """Python's ssl.CERT_NONE/OPTIONAL/REQUIRED, as 0/1/2 or by name."""
    if isinstance(value, str) and value.strip().upper() in _CERT_REQS:
        return _CERT_REQS[value.strip().upper()]
    try:
        number = integer(value)
    except ValueError:
        number = -1
    if number not in _CERT_REQS.values():
        raise ValueError(
            f"must be 0, 1 or 2 (CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED), got {value!r}"
        )
    return number


def cipher_list(value: Any) -> str:
    """An OpenSSL cipher list (TLS 1.2 and below), checked by OpenSSL itself."""
    text = string(value)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(text)
    except ssl.SSLError as error:
        reason = str(error.args[-1]).rstrip(".") if error.args else "refused"
        raise ValueError(f"{text!r} is not a cipher list OpenSSL accepts: {reason}") from None
    return text


def endpoint_paths(value: Any) -> list[str]:
    """vLLM's comma-separated request paths ("/health,/metrics"), each stripped, the empty
    ones dropped; a list of paths (a keyword argument) is taken as it is."""
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        items = list(value)
    elif isinstance(value, str):
        items = value.split(",")
    else:
        raise ValueError(f"must be paths separated by commas, got {value!r}")
    return [path.strip() for path in items if path.strip()]


def keep_alive_interval(value: Any) -> int:
    """Whole seconds, 0 for none (vLLM's --sse-keep-alive-interval: an int, refused below 0)."""
    number = integer(value)
    if number < 0:
        raise ValueError(
            f"must be a non-negative integer (0 disables keep-alive comments), got {number}"
        )
    return number


def root_path(value: Any) -> str:
    text = string(value)
    if not text.startswith("/"):
        raise ValueError(f"must start with '/', got {text!r}")
    return text.rstrip("/")


def import_paths(value: Any) -> list[str]:
    """Dotted import paths such as "package.module.name" (checked when the server imports them)."""
    paths = names(value)
    for path in paths:
        if "." not in path.strip("."):
            raise ValueError(f"must be import paths such as package.module.name, got {path!r}")
    return paths


def json_settings(
    fields: dict[str, Callable[[Any], Any]], unsupported: tuple[str, ...] = ()
) -> Callable[[Any], dict[str, Any]]:
    """A JSON object of named settings, each checked by its converter in `fields`; a key
    in `unsupported` is refused as not supported yet, any other as unknown."""

    def convert(value: Any) -> dict[str, Any]:
        settings = json_object(value)
        for key in settings:
            if key in unsupported:
                raise ValueError(f"key {key!r} is not supported by aioserve yet")
            if key not in fields:
                raise ValueError(f"has no key {key!r} (it takes {', '.join(fields)})")
        checked = {}
        for key, raw in settings.items():
            try:
                checked[key] = fields[key](raw)
            except ValueError as error:
                raise ValueError(f"key {key!r} {error}") from None
        return checked

    return convert


def one_of(*choices: str) -> Callable[[Any], str]:
    """A string among `choices`."""

    def convert(value: Any) -> str:
        text = string(value)
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}, got {text!r}")
        return text

    return convert


@dataclass(frozen=True)
class LoRAModulePath:
    """One adapter of --lora-modules: served as `name`, read from the PEFT folder `path`;
    /v1/models names `base_model_name` (default: the first served model name) its parent."""

    name: str
    path: str
    base_model_name: str | None = None


_LORA_MODULE_KEYS = ("name", "path", "base_model_name")


def _lora_module(item: Any) -> LoRAModulePath:
    if isinstance(item, LoRAModulePath):
        return item
    if isinstance(item, str) and "=" in item and "," not in item:  # vLLM's name=path
        name, path = item.split("=", 1)
        fields = {"name": name, "path": path}
    else:
        fields = item
        if isinstance(item, str):
            try:
                fields = json.loads(item)
            except json.JSONDecodeError:
                raise ValueError(
                    f"has an entry that is neither name=path nor JSON: {item!r}"
                ) from None
        if not isinstance(fields, dict):
            raise ValueError(f"entries must be name=path or a JSON object, got {item!r}")
        unknown = [key for key in fields if key not in _LORA_MODULE_KEYS]
        if unknown or "name" not in fields or "path" not in fields:
            raise ValueError(
                f"entries take the keys name and path (and base_model_name), got {item!r}"
            )
    for key in _LORA_MODULE_KEYS:
        value = fields.get(key)
        if (key != "base_model_name" or value is not None) and not (
            isinstance(value, str) and value
        ):
            raise ValueError(f"entry {item!r}: {key} must be a non-empty string")
    return LoRAModulePath(fields["name"], fields["path"], fields.get("base_model_name"))


def lora_modules(value: Any) -> list[LoRAModulePath]:
    """--lora-modules: adapters as vLLM takes them, `name=path` or a JSON object with name,
    path and optionally base_model_name; each name at most once."""
    items = [value] if isinstance(value, (str, dict, LoRAModulePath)) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"must be one or more adapters, got {value!r}")
    modules = [_lora_module(item) for item in items if item not in (None, "")]
    names = [module.name for module in modules]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"names an adapter more than once: {', '.join(repeated)}")
    return modules


def glob_patterns(value: Any) -> list[str]:
    """--ignore-patterns: glob patterns, one or several (a keyword may give one string); an
    empty list ignores nothing."""
    patterns = [value] if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"must be one or more glob patterns, got {value!r}")
    return list(patterns)


# Where aioserve can put a tensor: the CPU, or a GPU (NVIDIA's or AMD's, both "cuda" in torch)
_LOAD_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_MAP_LOCATIONS = (
    "a device (cpu, cuda or cuda:N) or a JSON object mapping the devices tensors were saved "
    'on to those (e.g. {"cuda:1": "cuda:0"})'
)


def map_location(value: Any) -> str | dict[str, str]:
    """--pt-load-map-location: torch.load's map_location, as vLLM takes it: a device or a
    JSON object {saved device: device}; from Python, a str or a dict."""
    if isinstance(value, str) and re.fullmatch(r"\s*\{.*\}\s*", value, re.DOTALL):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"is not valid JSON: {value!r} ({error})") from None
    if isinstance(value, str) and _LOAD_DEVICE.fullmatch(value):
        return value
    if isinstance(value, dict) and all(
        isinstance(key, str) and isinstance(target, str) and _LOAD_DEVICE.fullmatch(target)
        for key, target in value.items()
    ):
        return dict(value)
    raise ValueError(f"must be {_MAP_LOCATIONS}, got {value!r}")
