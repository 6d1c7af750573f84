"""Tool calls: model outputs read into OpenAI tool calls, whole or as they stream.

`parsers` holds vLLM's first formats (hermes, llama3_json, mistral, pythonic) and the
registry a --tool-parser-plugin adds to; `json_list_formats` (granite, phi4_mini_json,
xlam), `special_token_formats` (internlm, deepseek_v3) and `xml_formats` (qwen3_coder)
register more, imported here for that. `strict_tags` holds calls to the tools in the
parser's own format with a structural tag: "auto" calls where --tool-strict-level asks,
and tool_choice "required" and a named function where the parser has a structural form
(vLLM 0.32); `forced` forces and reads those two as bare JSON otherwise. `streaming` makes
the deltas of one choice, and `partial_json` reads JSON still being generated.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import FrontendConfig

# Imported for their parsers, which they register by name.
from aioserve.server.tool_calls import (  # noqa: F401
    json_list_formats,
    special_token_formats,
    xml_formats,
)
from aioserve.server.tool_calls.parsers import (
    ToolParser,
    new_tool_parser,
    register_tool_parser,
    tool_parser_names,
)

__all__ = ["ToolParser", "check_tool_call_settings", "register_tool_parser"]


def check_tool_call_settings(frontend: FrontendConfig) -> None:
    """Import --tool-parser-plugin, then check --tool-call-parser,
    --enable-auto-tool-choice and --tool-strict-level; a ConfigError naming the flag
    otherwise."""
    if frontend.tool_parser_plugin:
        _import_plugin(Path(frontend.tool_parser_plugin))
    if (
        frontend.tool_call_parser is not None
        and frontend.tool_call_parser not in tool_parser_names()
    ):
        raise ConfigError(
            f"tool-call parser {frontend.tool_call_parser!r} is not supported by aioserve yet "
            f"(--tool-call-parser accepts {', '.join(tool_parser_names())}; a "
            "--tool-parser-plugin may register more)"
        )
    if frontend.enable_auto_tool_choice and frontend.tool_call_parser is None:
        raise ConfigError("--enable-auto-tool-choice requires --tool-call-parser")
    if frontend.tool_strict_level != "auto":
        parser = frontend.tool_call_parser
        if parser is None or new_tool_parser(parser).structural_form is None:
            with_form = [n for n in tool_parser_names() if new_tool_parser(n).structural_form]
            raise ConfigError(
                f"--tool-strict-level {frontend.tool_strict_level} needs a --tool-call-parser "
                f"whose calls have a structural form ({', '.join(with_form)}); "
                + (f"{parser!r} has none" if parser else "none is given")
            )


def _import_plugin(path: Path) -> None:
    spec = importlib.util.spec_from_file_location(f"aioserve_tool_plugin_{path.stem}", path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise ConfigError(f"--tool-parser-plugin {path}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ConfigError(f"--tool-parser-plugin {path}: importing it failed: {error}") from None
