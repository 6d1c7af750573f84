"""--enable-auto-tool-choice, --tool-call-parser and --tool-parser-plugin, checked at start."""

from __future__ import annotations

import pytest

from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config
from aioserve.server.tool_calls import check_tool_call_settings
from aioserve.server.tool_calls.parsers import new_tool_parser, tool_parser_names

PLUGIN = """
from aioserve.server.tool_calls import register_tool_parser
from aioserve.server.tool_calls.parsers import CallSoFar, ParsedOutput, ToolParser


@register_tool_parser("shout")
class ShoutParser(ToolParser):
    def parse(self, text, final):
        if not text.startswith("CALL "):
            return ParsedOutput(text)
        return ParsedOutput("", [CallSoFar(text[5:].strip(), "{}", complete=True)])
"""


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"tool_call_parser": "qwen3_xml"}, "tool-call parser 'qwen3_xml' is not supported"),
        (
            {"enable_auto_tool_choice": True},
            "--enable-auto-tool-choice requires --tool-call-parser",
        ),
        ({"tool_parser_plugin": "/no/such/plugin.py"}, "no such Python file"),
    ],
)
def test_refused_settings_name_the_flag(settings, message):
    with pytest.raises(ConfigError, match=message):
        check_tool_call_settings(frontend_config(**settings))


def test_a_plugin_registers_a_parser(tmp_path):
    plugin = tmp_path / "shout.py"
    plugin.write_text(PLUGIN)
    frontend = frontend_config(
        tool_parser_plugin=str(plugin), tool_call_parser="shout", enable_auto_tool_choice=True
    )
    check_tool_call_settings(frontend)
    assert "shout" in tool_parser_names()
    (call,) = new_tool_parser("shout").read("CALL ping", final=True).calls
    assert call.name == "ping"


def test_a_broken_plugin_is_refused(tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match="importing it failed: boom"):
        check_tool_call_settings(frontend_config(tool_parser_plugin=str(plugin)))
