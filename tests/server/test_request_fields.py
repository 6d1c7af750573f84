"""Request keys outside vLLM's request models are logged as vLLM logs them, over real HTTP.

The routes that read a body (completions, chat completions, tokenize, detokenize) are
served in-process (conftest's `serve_app` on the shared engine). Reference: vLLM 0.32's
`OpenAIBaseModel.__log_extra_fields__`, which logs at DEBUG "The following fields were
present in the request but ignored: {'foo'}"; the field sets themselves (request_fields.py)
were copied from vLLM's models. vLLM 0.32 also ignores, with a warning, the guided_* fields
it removed; aioserve honours them, so it neither warns nor logs them as ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from aioserve.server import body_fields, chat, completions, protocol, routes
from aioserve.server.chat_template import UNTRUSTED_TEMPLATE
from aioserve.server.errors import error_middleware
from aioserve.server.openai_routes import add_openai_routes
from aioserve.server.request_fields import (
    CHAT_COMPLETION_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    REMOVED_GUIDED_FIELDS,
    TOKENIZE_CHAT_FIELDS,
    TOKENIZE_PROMPT_FIELDS,
)
from aioserve.server.request_schema import CHAT_BODY, COMPLETION_BODY
from aioserve.server.state import STATE, ServerState
from tests.server.conftest import MODEL, serve_app
from tests.server.openai_helpers import post

pytestmark = pytest.mark.slow

IGNORED = "The following fields were present in the request but ignored: "
MESSAGES = [{"role": "user", "content": "Hi"}]

# Per route: a body of known fields that succeeds, and the fields vLLM's model has.
ROUTES = {
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}, COMPLETION_FIELDS),
    "chat": (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 1},
        CHAT_COMPLETION_FIELDS,
    ),
    "tokenize-prompt": ("/tokenize", {"prompt": "Hi"}, TOKENIZE_PROMPT_FIELDS),
    "tokenize-chat": ("/tokenize", {"messages": MESSAGES}, TOKENIZE_CHAT_FIELDS),
    "detokenize": ("/detokenize", {"tokens": [19556, 905]}, DETOKENIZE_FIELDS),
}


@pytest.fixture(scope="module")
def server(engine, server_loop) -> Iterator[str]:
    """Base URL of an app with the four routes that read a request body."""
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = ServerState(engine, [MODEL])
    add_openai_routes(app)
    routes.add_routes(app, load_tracking=False)
    with serve_app(server_loop, app) as url:
        yield url


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="aioserve")
    return caplog


def ignored_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The "ignored" lines logged at DEBUG on aioserve's loggers."""
    return [
        record.getMessage()
        for record in caplog.records
        if record.name.startswith("aioserve")
        and record.levelno == logging.DEBUG
        and record.getMessage().startswith(IGNORED)
    ]


def guided_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno == logging.WARNING and "guided-decoding" in record.getMessage()
    ]


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_field_succeeds_and_is_logged_as_vllm_logs_it(server, debug_log, route):
    path, body, _ = ROUTES[route]
    reply = post(server, path, {**body, "foo": 1})
    assert reply.status == 200, reply.body
    assert ignored_messages(debug_log) == [IGNORED + "{'foo'}"]


@pytest.mark.parametrize("route", ROUTES)
def test_known_fields_log_nothing(server, debug_log, route):
    path, body, _ = ROUTES[route]
    reply = post(server, path, {**body, "model": MODEL})
    assert reply.status == 200, reply.body
    assert ignored_messages(debug_log) == []


def test_a_guided_field_is_honoured_and_logged_as_nothing(server, debug_log):
    body = {"prompt": "Hi", "max_tokens": 3, "guided_choice": ["yes", "no"], "foo": 1}
    reply = post(server, "/v1/completions", body)
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["text"] in ("yes", "no")
    assert ignored_messages(debug_log) == [IGNORED + "{'foo'}"]
    assert guided_warnings(debug_log) == []


def test_the_field_sets_hold_what_vllm_and_aioserve_share():
    for fields in ROUTES.values():
        assert fields[2], "an empty set would report every field as ignored"
    assert "top_k" in COMPLETION_FIELDS and "top_k" in CHAT_COMPLETION_FIELDS
    # Every field aioserve reads is one vLLM's request model has.
    # vLLM removed the guided fields from its models: to it they are extra keys; aioserve
    # still reads them.
    assert not REMOVED_GUIDED_FIELDS & (COMPLETION_FIELDS | CHAT_COMPLETION_FIELDS)
    assert set(COMPLETION_BODY) <= COMPLETION_FIELDS | REMOVED_GUIDED_FIELDS
    assert set(CHAT_BODY) <= CHAT_COMPLETION_FIELDS | REMOVED_GUIDED_FIELDS


class RecordingBody(dict):
    """A request body that notes which of its keys the handler looks up."""

    def __init__(self, body: dict[str, Any], looked_up: set[str]) -> None:
        super().__init__(body)
        self.looked_up = looked_up

    def get(self, key: str, default: Any = None) -> Any:
        self.looked_up.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.looked_up.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up.add(str(key))
        return super().__contains__(key)


@pytest.mark.parametrize("route", ROUTES)
def test_no_field_aioserve_reads_can_be_reported_as_ignored(server, monkeypatch, route):
    looked_up: set[str] = set()
    read_json_body = body_fields.read_json_body

    async def recording_read(request: web.Request) -> dict[str, Any]:
        return RecordingBody(await read_json_body(request), looked_up)

    for module in (completions, chat, routes):
        monkeypatch.setattr(module, "read_json_body", recording_read)
    path, body, known = ROUTES[route]
    assert post(server, path, body).status == 200
    # Fields looked up only to be refused when set are not read, nor the guided_* fields
    # vLLM removed and aioserve still honours (not logged: see above); /tokenize looks up
    # `messages` to choose vLLM's model, and takes the prompt one only when it is absent.
    read = looked_up - set(protocol._UNSUPPORTED) - REMOVED_GUIDED_FIELDS
    if route == "tokenize-prompt":
        # and, as vLLM's request union refuses both set on a prompt body too, the two flags.
        read -= {"messages", "add_generation_prompt", "continue_final_message"}
    assert read, "nothing was recorded"
    assert read <= known, f"read by aioserve but not in vLLM's fields: {read - known}"


# vLLM fields aioserve neither reads nor refuses, each because ignoring it cannot change
# what a request means: it only tunes what aioserve does not do, or is a routing hint.
HARMLESS_WHEN_IGNORED = {
    "length_penalty": "beam search's alone: read with use_beam_search, ignored without (vLLM's)",
    "stream_interval": "how many tokens vLLM batches per stream chunk, not what is sent",
    "session_id": "a routing hint for vLLM's session-aware schedulers",
    "routed_experts_prompt_start": "MoE routing records, off unless a server flag asks",
}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_vllm_field_is_read_refused_or_harmless_to_ignore(server, monkeypatch, route):
    """A field vLLM honours must not be dropped silently: that would answer another request."""
    looked_up: set[str] = set()
    read_json_body = body_fields.read_json_body

    async def recording_read(request: web.Request) -> dict[str, Any]:
        return RecordingBody(await read_json_body(request), looked_up)

    for module in (completions, chat):
        monkeypatch.setattr(module, "read_json_body", recording_read)
    path, body, known = ROUTES[route]
    # Every optional field aioserve reads, set, so that each branch looks its fields up.
    if route == "completions":
        body = {**body, "stream": True, "stream_options": {"include_usage": True}, "echo": True}
    else:
        body = {**body, "logprobs": True, "top_logprobs": 1}
    assert post(server, path, body).status == 200
    refused = set(protocol._UNSUPPORTED) | {name for name, *_ in protocol._DEFAULT_ONLY}
    unaccounted = known - looked_up - refused - set(HARMLESS_WHEN_IGNORED)
    assert not unaccounted, f"vLLM fields aioserve drops silently: {sorted(unaccounted)}"


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("completions", "logprob_token_ids", [1]),
        ("completions", "add_special_tokens", False),
        ("completions", "return_token_offsets", True),
    ],
)
def test_a_vllm_field_aioserve_cannot_honour_is_a_400_naming_it(server, route, field, value):
    path, body, _ = ROUTES[route]
    reply = post(server, path, {**body, field: value})
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["param"] == field


def test_a_chat_template_in_the_request_gets_vllms_untrusted_template_400(server):
    path, body, _ = ROUTES["chat"]
    for fields in ({"chat_template": "{{ messages }}"},
                   {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}):  # fmt: skip
        reply = post(server, path, {**body, **fields})
        assert reply.status == 400, reply.body
        assert reply.json()["error"]["message"] == UNTRUSTED_TEMPLATE


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        ("completions", "add_special_tokens", True),
        ("chat", "add_special_tokens", False),
        ("chat", "add_special_tokens", True),
        ("chat", "documents", [{"text": "x"}]),
        ("chat", "reasoning_effort", "low"),
    ],
)
def test_vllm_values_aioserve_honours_are_accepted(server, route, field, value):
    path, body, _ = ROUTES[route]
    assert post(server, path, {**body, field: value}).status == 200
