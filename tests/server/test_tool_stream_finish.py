"""A streamed "auto" answer's calls end to end (hermes, on the default model, its output
forced by a regex): parallel_tool_calls false streams only the first call, and a
finish_reason other than "stop" (max_tokens) stays as the engine gave it, with an empty
delta, as vLLM's chat_completion/serving.py sends it.
"""

from __future__ import annotations

import json

import pytest

from aioserve.config.frontend import frontend_config
from tests.server.conftest import MODEL
from tests.server.openai_helpers import post
from tests.server.test_tools import TEMPLATE, WEATHER

CALLS = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'
    r'<tool_call>\{"name": "get_time", "arguments": \{\}\}</tool_call>'
)
TIME = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture
def url(start_openai_server):
    frontend = frontend_config(
        enable_auto_tool_choice=True, tool_call_parser="hermes", chat_template=TEMPLATE
    )
    return start_openai_server(frontend=frontend)


def chunks(url: str, **fields) -> list[dict]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": [WEATHER, TIME],
        "temperature": 0,
        "stream": True,
        **fields,
    }
    reply = post(url, "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    lines = reply.body.decode().split("\n\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def call_names(events: list[dict]) -> list[str]:
    return [
        delta["function"]["name"]
        for event in events
        for choice in event["choices"]
        for delta in choice["delta"].get("tool_calls") or []
        if "name" in delta["function"]
    ]


def test_streamed_calls_parallel_and_finish(url):
    regex = {"structured_outputs": {"regex": CALLS}}
    both = chunks(url, **regex, max_tokens=200)
    assert call_names(both) == ["get_weather", "get_time"]
    assert both[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_calls_utils.py maybe_filter_parallel_tool_calls: index 0 only
    first = chunks(url, **regex, max_tokens=200, parallel_tool_calls=False)
    assert call_names(first) == ["get_weather"]
    # serving.py: "tool_calls" only when the engine's finish_reason is "stop"
    cut = chunks(url, structured_outputs={"regex": CALLS + "( ok)+"}, max_tokens=120)
    assert call_names(cut) == ["get_weather", "get_time"]
    last = cut[-1]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"] == {}
