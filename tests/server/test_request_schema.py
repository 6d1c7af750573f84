"""The request fields declared in aioserve/server/request_schema.py are the fields the
server reads: every declared field of /v1/completions and /v1/chat/completions, sent with a
value of the wrong JSON type, is a 400 naming that field (a field declared, and so shown in
/openapi.json, but never read would be accepted)."""

from __future__ import annotations

from typing import Any

import pytest

from aioserve.server.request_schema import CHAT_BODY, COMPLETION_BODY, STREAM_OPTIONS_BODY
from tests.server.conftest import MODEL
from tests.server.serve_process import fetch, openai_error

BASES = {
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 1},
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
    },
}
DECLARED = {"/v1/completions": COMPLETION_BODY, "/v1/chat/completions": CHAT_BODY}
# A value of another JSON type than each kind.
WRONG_VALUES: dict[str, Any] = {
    "boolean": "yes",
    "integer": "ten",
    "number": "ten",
    "string": 5,
    "array": "x",
    "object": [1],
    "string or array": 5,
    "string or object": 5,
}
# Read by protocol.py's own code, with their own messages (test_malformed_requests.py).
OWN_READERS = {"prompt", "messages"}

CASES = [
    (path, name, field.kind)
    for path, declared in DECLARED.items()
    for name, field in declared.items()
    if name not in OWN_READERS
]


@pytest.mark.parametrize(("path", "name", "kind"), CASES, ids=[f"{p}:{n}" for p, n, _ in CASES])
def test_a_declared_field_of_the_wrong_type_is_a_400_naming_it(openai_server, path, name, kind):
    body = BASES[path] | {name: WRONG_VALUES[kind]}
    if name == "stream_options":
        body["stream"] = True
    reply = fetch("POST", openai_server + path, body=body)
    assert reply.status == 400, reply.body[:300]
    assert openai_error(reply)["param"] == name


@pytest.mark.parametrize("name", list(STREAM_OPTIONS_BODY))
def test_stream_options_fields_are_read_with_their_types(openai_server, name):
    body = BASES["/v1/completions"] | {"stream": True, "stream_options": {name: "yes"}}
    reply = fetch("POST", openai_server + "/v1/completions", body=body)
    assert reply.status == 400
    assert openai_error(reply)["param"] == f"stream_options.{name}"
