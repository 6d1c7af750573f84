"""Constraints compiled once, cached, and turned into one matcher per sequence.

`StructuredOutputCompiler.compile(params)` picks the backend (matchers.py,
xgrammar_backend.py) and compiles:

- `auto` (the default): outlines for regexes, choices and the JSON schemas its regexes
  enforce entirely; guidance for grammars, any-JSON objects and the schemas that use a
  keyword outlines would silently ignore (`minimum`, `multipleOf`, ...), so that every
  output validates against its schema; guidance for structural tags of the trigger form
  (their JSON spaced as other JSON here), xgrammar for xgrammar's form. A constraint
  outlines refuses falls back to guidance unless --guided-decoding-disable-fallback.
  (vLLM's `auto` tries xgrammar first for everything; xgrammar lets JSON hold any
  whitespace, which a small model fills until max_tokens.)
- `outlines`: as auto without the fallback, grammars excepted (outlines hands them to
  llguidance too); a schema keyword it cannot enforce is refused by name, and so are
  structural tags.
- `guidance`: everything through llguidance; structural tags of the trigger form only.
- `xgrammar`: everything through xgrammar, with vLLM's settings for it.

Compiled constraints are cached by (backend, kind, constraint, whitespace) in a small LRU.
`compile_async` compiles on a thread of its own, so that a slow schema never holds up the
event loop (outlines' compiler releases the GIL); the server awaits it before it admits a
request, and a constraint that does not compile is an InvalidRequest naming its field.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.structured_outputs.json_schemas import (
    forbid_additional_properties,
    keyword_outlines_ignores,
    keyword_xgrammar_ignores,
    parse_schema,
)
from aioserve.engine.structured_outputs.params import (
    StructuredOutputsConfig,
    StructuredOutputsParams,
)
from aioserve.engine.structured_outputs.structural_tags import tagged_structures, uses_triggers

if TYPE_CHECKING:  # the backends load with the first constraint (see _backends)
    from aioserve.engine.structured_outputs.matchers import (
        GuidanceGrammar,
        Matcher,
        OutlinesIndex,
        TokenBytes,
    )
    from aioserve.engine.structured_outputs.xgrammar_backend import (
        XgrammarCompiler,
        XgrammarGrammar,
    )

    Compiled = OutlinesIndex | GuidanceGrammar | XgrammarGrammar

BACKENDS = ("auto", "outlines", "guidance", "xgrammar")
VLLM_BACKENDS = ("lm-format-enforcer",)  # vLLM's other: refused by name
CACHE_SIZE = 256

# outlines' own default: at most one space where JSON allows whitespace. Free whitespace
# lets a small model loop on newlines until max_tokens, leaving the JSON unfinished.
DEFAULT_JSON_WHITESPACE = "[ ]?"


def _backends():
    """matchers.py, imported on first use: a server that never sees a constraint does not
    load outlines-core and llguidance (nor need them installed)."""
    from aioserve.engine.structured_outputs import matchers

    return matchers


def _xgrammar():
    """xgrammar_backend.py, imported on first use, as _backends."""
    from aioserve.engine.structured_outputs import xgrammar_backend

    return xgrammar_backend


class StructuredOutputCompiler:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        vocab_size: int,
        config: StructuredOutputsConfig,
        max_drafts: int = 0,
    ) -> None:
        self.config = config
        self.max_drafts = max_drafts  # what a matcher may have to take back (step_masks.py)
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._tokens: TokenBytes | None = None
        self._xgrammar: XgrammarCompiler | None = None
        self._lock = threading.Lock()  # the cache's; held for lookups only
        self._tokens_lock = threading.Lock()  # held while the token bytes are read (0.4 s)
        self._cache: OrderedDict[tuple, Compiled] = OrderedDict()
        self._executor: ThreadPoolExecutor | None = None

    def new_matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A matcher for one sequence (compiling the constraint unless it is cached)."""
        return self.compile(params).new_matcher(self.max_drafts)

    async def compile_async(self, params: StructuredOutputsParams) -> None:
        """Compile `params` off the event loop, so that `new_matcher` finds it cached."""
        if self._cached(self._key(params)) is not None:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="aioserve-grammar")
        await asyncio.get_running_loop().run_in_executor(self._executor, self.compile, params)

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        """The compiled constraint; InvalidRequest naming the field when it cannot be."""
        key = self._key(params)
        compiled = self._cached(key)
        if compiled is None:
            compiled = self._compile(params, *key)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return compiled

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals ------------------------------------------------------------------------------

    def _cached(self, key: tuple) -> Compiled | None:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _key(self, params: StructuredOutputsParams) -> tuple[str, str, str, str, bool]:
        backend = params.backend or self.config.backend
        if backend in VLLM_BACKENDS:
            raise InvalidRequest(
                f"structured-output backend {backend!r} is not supported by aioserve yet "
                f"(it has {', '.join(BACKENDS)})",
                "structured_outputs.backend",
                backend,
            )
        if backend not in BACKENDS:
            raise InvalidRequest(
                f"unknown structured-output backend {backend!r}; choose one of "
                f"{', '.join(BACKENDS)}",
                "structured_outputs.backend",
                backend,
            )
        if params.disable_any_whitespace or self.config.disable_any_whitespace:
            whitespace = ""
        elif params.whitespace_pattern is not None:
            whitespace = params.whitespace_pattern
        else:
            whitespace = DEFAULT_JSON_WHITESPACE
        no_additional = (
            params.disable_additional_properties or self.config.disable_additional_properties
        )
        return (backend, *params.kind_and_spec(), whitespace, no_additional)

    def _loaded_tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            raise InvalidRequest(
                "structured outputs need the tokenizer, which is not loaded "
                "(--skip-tokenizer-init)",
                "structured_outputs",
                None,
            )
        return self._tokenizer

    def _token_bytes(self) -> TokenBytes:
        with self._tokens_lock:
            if self._tokens is None:
                tokenizer = self._loaded_tokenizer()
                self._tokens = _backends().TokenBytes(tokenizer, self._vocab_size)
            return self._tokens

    def _xgrammar_compiler(self) -> XgrammarCompiler:
        with self._tokens_lock:
            if self._xgrammar is None:
                tokenizer = self._loaded_tokenizer()
                self._xgrammar = _xgrammar().XgrammarCompiler(tokenizer, self._vocab_size)
            return self._xgrammar

    def _compile(
        self, params: StructuredOutputsParams, backend: str, kind: str, spec: str,
        whitespace: str, no_additional: bool,
    ) -> Compiled:  # fmt: skip
        field = f"structured_outputs.{kind}"
        value: Any = getattr(params, kind)
        tag = json.loads(spec) if kind == "structural_tag" else None
        if backend == "auto" and tag is not None and not uses_triggers(tag):
            backend = "xgrammar"  # the only reader of xgrammar's form
        if backend == "xgrammar":
            return self._compile_xgrammar(params, kind, spec, no_additional)
        tokens = self._token_bytes()
        if tag is not None:
            return self._compile_tag_guidance(backend, tag, whitespace, tokens, value)
        if kind == "json":
            schema = parse_schema(spec)  # StructuredOutputsParams checked it
            if no_additional:
                schema = forbid_additional_properties(copy.deepcopy(schema))
        elif kind == "json_object":
            schema = {"type": "object"}
        if kind == "grammar" or (kind == "json_object" and backend != "outlines"):
            backend = "guidance"
        outlines_error = None
        if backend != "guidance":
            try:
                outline_schema = schema if kind in ("json", "json_object") else None
                return self._compile_outlines(kind, spec, outline_schema, whitespace, tokens)
            except ValueError as error:
                outlines_error = str(error)
            if backend == "outlines" or self.config.disable_fallback:
                raise InvalidRequest(
                    f"the {kind} constraint cannot be compiled by outlines: {outlines_error}",
                    field,
                    value,
                )
        try:
            if kind == "json" or kind == "json_object":
                grammar = _backends().guidance_json_grammar(schema, whitespace)
            else:
                grammar = _backends().guidance_grammar(
                    kind, ascii_shorthands(spec) if kind == "regex" else spec
                )
            return _backends().GuidanceGrammar.compile(grammar, tokens)
        except ValueError as error:
            reason = str(error).strip()
            if outlines_error is not None:
                reason = f"{outlines_error} (outlines); {reason} (guidance)"
            raise InvalidRequest(
                f"the {kind} constraint cannot be compiled: {reason}", field, value
            ) from None

    def _compile_xgrammar(
        self, params: StructuredOutputsParams, kind: str, spec: str, no_additional: bool
    ) -> XgrammarGrammar:
        field = f"structured_outputs.{kind}"
        if params.whitespace_pattern is not None:
            raise InvalidRequest(
                "the xgrammar backend does not take whitespace_pattern (outlines and "
                "guidance do); use disable_any_whitespace, or another backend",
                "structured_outputs.whitespace_pattern",
                params.whitespace_pattern,
            )
        if kind == "json":
            schema = parse_schema(spec)
            if no_additional:
                schema = forbid_additional_properties(copy.deepcopy(schema))
            ignored = keyword_xgrammar_ignores(schema)
            if ignored is not None:
                raise InvalidRequest(
                    f"the json constraint cannot be compiled by xgrammar: it does not "
                    f"enforce {ignored}",
                    field,
                    params.json,
                )
            spec = json.dumps(schema)
        any_whitespace = not (params.disable_any_whitespace or self.config.disable_any_whitespace)
        compiler = self._xgrammar_compiler()
        try:
            return compiler.compile(kind, spec, any_whitespace)
        except ValueError as error:
            raise InvalidRequest(
                f"the {kind} constraint cannot be compiled by xgrammar: {error}",
                field,
                getattr(params, kind),
            ) from None

    @staticmethod
    def _compile_tag_guidance(
        backend: str, tag: dict[str, Any], whitespace: str, tokens: TokenBytes, value: Any
    ) -> GuidanceGrammar:
        field = "structured_outputs.structural_tag"
        if backend == "outlines":
            raise InvalidRequest(
                "the outlines backend does not enforce structural tags (xgrammar and guidance do)",
                field,
                value,
            )
        if not uses_triggers(tag):
            raise InvalidRequest(
                'the guidance backend takes structural tags of "structures" and "triggers" '
                'only; xgrammar reads the "format" form',
                field,
                value,
            )
        grammar = _backends().guidance_tag_grammar(
            tagged_structures(tag), whitespace, tokens.special_tokens
        )
        try:
            return _backends().GuidanceGrammar.compile(grammar, tokens)
        except ValueError as error:
            raise InvalidRequest(
                f"the structural_tag constraint cannot be compiled: {str(error).strip()}",
                field,
                value,
            ) from None

    @staticmethod
    def _compile_outlines(
        kind: str, spec: str, schema: dict[str, Any] | None, whitespace: str, tokens: TokenBytes
    ) -> OutlinesIndex:
        if schema is not None:
            ignored = keyword_outlines_ignores(schema)
            if ignored is not None:
                raise ValueError(f"it does not enforce the schema keyword {ignored!r}")
            regex = _backends().json_schema_regex(schema, whitespace)
        elif kind == "choice":
            regex = choice_regex(spec)
        else:
            regex = spec
        return _backends().OutlinesIndex.compile(ascii_shorthands(regex), tokens)


def choice_regex(spec: str) -> str:
    """A regex matching exactly one of the choices (a JSON list of strings)."""
    return "(" + "|".join(_escape(choice) for choice in json.loads(spec)) + ")"


# `\d`, `\w` and `\s` as vLLM's default backend (xgrammar) reads them, in ASCII; outlines'
# regex engine would take any Unicode digit, letter or space (a date's year "🯱🯱🯱🯱").
_ASCII_SHORTHANDS = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_shorthands(regex: str) -> str:
    """`regex` with its \\d, \\w and \\s written as ASCII ranges (inside a class, the
    ranges alone); escaped backslashes and every other escape are left as they are."""
    out, in_class, i = [], False, 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            ranges = _ASCII_SHORTHANDS.get(escaped)
            if ranges is None:
                out.append(regex[i : i + 2])
            else:
                out.append(ranges if in_class else f"[{ranges}]")
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            if regex[i + 1 : i + 2] == "^":  # a leading ^ or ] belongs to the class
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":
                out.append("]")
                i += 1
        elif char == "]" and in_class:
            in_class = False
            out.append(char)
        else:
            out.append(char)
        i += 1
    return "".join(out)


def _escape(text: str) -> str:
    # Only the metacharacters: outlines' regex syntax refuses some of Python's escapes.
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


_REGEX_META = frozenset("\\.+*?()|[]{}^$")
