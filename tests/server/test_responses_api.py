"""POST /v1/responses over real HTTP: the official openai client reads our responses and
streams; every object has the keys of vLLM 0.32's, in its order (vllm_samples/30-33);
the text is what the same messages give through /v1/chat/completions (greedy); and the
requests vLLM refuses, or aioserve cannot serve yet, get their errors, naming the field."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from tests.server.conftest import MODEL
from tests.server.openai_helpers import client, post, sample, sample_stream, shape
from tests.server.serve_process import fetch

pytestmark = pytest.mark.slow

MESSAGES_BODY = sample("31_responses_messages")["request"]["body"]


def _body(**fields) -> dict:
    return {"model": MODEL, "temperature": 0, **fields}


def _named_events(raw: bytes) -> list[tuple[str, dict]]:
    """(name, data) of each event of a Responses stream: `event:` then `data:`, no [DONE]."""
    frames = raw.split(b"\n\n")
    assert frames[-1] == b"", raw[-200:]
    events = []
    for frame in frames[:-1]:
        name_line, data_line = frame.split(b"\n")
        assert name_line.startswith(b"event: ") and data_line.startswith(b"data: "), frame
        data = json.loads(data_line[len(b"data: ") :])
        assert name_line[len(b"event: ") :].decode() == data["type"]
        events.append((data["type"], data))
    return events


def _chat_text(server: str, body: dict) -> str:
    messages = (
        [{"role": "system", "content": body["instructions"]}] if "instructions" in body else []
    )
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in items:
        content = item["content"]
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        messages.append({"role": item["role"], "content": content})
    reply = client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=body["max_output_tokens"], temperature=0
    )
    return reply.choices[0].message.content


def test_a_response_has_vllms_shape_and_the_chat_answer(openai_server):
    body = {**MESSAGES_BODY, "model": MODEL}
    reply = post(openai_server, "/v1/responses", body)
    assert reply.status == 200
    got = reply.json()
    assert shape(got) == shape(sample("31_responses_messages")["response"]["body"])
    assert got["id"].startswith("resp_") and got["output"][0]["id"].startswith("msg_")
    assert got["instructions"] == "You are terse." and got["status"] == "completed"
    assert got["output"][0]["content"][0]["text"] == _chat_text(openai_server, body)
    usage = got["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_the_openai_client_reads_an_incomplete_response(openai_server):
    response = client(openai_server).responses.create(
        model=MODEL, input="Write a long story about the sea.", max_output_tokens=5, temperature=0
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    assert response.output_text == _chat_text(
        openai_server, {"input": "Write a long story about the sea.", "max_output_tokens": 5}
    )
    raw = post(openai_server, "/v1/responses", _body(input="Hi", max_output_tokens=1)).json()
    assert shape(raw) == shape(sample("30_responses_incomplete")["response"]["body"])


def test_a_stream_is_vllms_events_and_the_openai_client_reads_it(openai_server):
    body = _body(input="Say hi.", max_output_tokens=4, stream=True)
    ours = _named_events(post(openai_server, "/v1/responses", body).body)
    theirs = _named_events(sample_stream("32_responses_stream"))

    def collapsed(events):  # consecutive deltas as one
        names = [name for name, _ in events]
        return [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]

    assert collapsed(ours) == collapsed(theirs)
    for (name, data), (_, reference) in zip(ours, theirs, strict=False):
        assert shape(data) == shape(reference), name
    assert [data["sequence_number"] for _, data in ours] == list(range(len(ours)))
    deltas = "".join(data["delta"] for name, data in ours if name == "response.output_text.delta")
    final = ours[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == deltas
    assert final["usage"]["output_tokens"] == 4

    stream = client(openai_server).responses.create(**{**body, "stream": True})
    events = list(stream)
    assert events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == deltas  # greedy: the same answer


def test_text_format_json_schema_constrains_the_answer(openai_server):
    request = sample("33_responses_json_schema")["request"]["body"]
    got = post(openai_server, "/v1/responses", {**request, "model": MODEL}).json()
    assert shape(got) == shape(sample("33_responses_json_schema")["response"]["body"])
    assert got["text"] == sample("33_responses_json_schema")["response"]["body"]["text"]
    schema = request["text"]["format"]["schema"]
    jsonschema.validate(json.loads(got["output"][0]["content"][0]["text"]), schema)


@pytest.mark.parametrize(
    "fields, status, words",
    [
        ({}, 400, "the field `input` is required"),
        ({"input": []}, 400, "Cannot apply chat template to an empty conversation"),
        ({"input": "x", "max_output_tokens": -1}, 400, "max_tokens must be at least 1, got -1"),
        ({"input": "x", "max_output_tokens": 10**6}, 400, "max_output_tokens=1000000 cannot be"),
        ({"input": "x", "temperature": -1}, 400, "temperature must be non-negative"),
        ({"input": "x", "previous_response_id": "resp_1"}, 404, "Response with id 'resp_1' not"),
        ({"input": "x", "background": True}, 400, "does not support the background mode"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            400,
            "is not a multimodal model",
        ),
        (
            {"input": "x", "tools": [{"type": "web_search"}]},
            400,
            "tools of type 'web_search' are not supported yet",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "'item_reference' are not"),
        ({"input": [{"type": "function_call_output"}]}, 400, "needs a call_id and an output"),
        (
            {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2},
            400,
            "include 'message.output_text.logprobs' (logprobs) in /v1/responses is not",
        ),
        (
            {"input": "x", "background": True, "store": False},
            400,
            "background can only be used when `store` is true",
        ),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_object"}},
                "structured_outputs": {"regex": "a+"},
            },
            400,
            "Cannot specify both structured_outputs and text.format",
        ),
        ({"input": "x", "tool_choice": "required"}, 400, "Tool choice 'required' must be"),
        ({"input": "x", "watermarking": True}, 400, "watermarking"),
        ({"input": "x", "metadata": {"a": 1}}, 400, "metadata must be an object of strings"),
        ({"input": "x", "service_tier": None}, 400, "service_tier must be one of auto"),
        ({"input": "x", "reasoning": "high"}, 400, "reasoning must be an object"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format must be text"),
        ({"input": [{"role": "robot", "content": "x"}]}, 400, "role must be one of user"),
        ({"model": "nope", "input": "x"}, 404, "The model `nope` does not exist"),
    ],
)
def test_refusals_name_the_field(openai_server, fields, status, words):
    reply = post(openai_server, "/v1/responses", {"model": MODEL, **fields})
    assert reply.status == status, reply.body
    error = reply.json()["error"]
    assert words in error["message"] and error["code"] == status


def test_nothing_is_stored(openai_server):
    # store (the Responses API's default) is accepted and, as vLLM's default, has no effect.
    created = post(openai_server, "/v1/responses", _body(input="Hi", max_output_tokens=2))
    assert created.status == 200
    response_id = created.json()["id"]
    for method, path in (("GET", ""), ("POST", "/cancel")):
        reply = fetch(method, f"{openai_server}/v1/responses/{response_id}{path}")
        assert reply.status == 404
        assert reply.json()["error"]["message"] == f"Response with id '{response_id}' not found."


def test_with_a_reasoning_parser_the_reasoning_is_an_item(openai_server, engine, monkeypatch):
    # SmolLM2 never closes a <think>: under deepseek_r1 its whole answer is reasoning.
    body = _body(input="Why is the sky blue?", max_output_tokens=6)
    plain = post(openai_server, "/v1/responses", body).json()["output"][0]["content"][0]["text"]
    settings = dataclasses.replace(engine.settings, reasoning_parser="deepseek_r1")
    monkeypatch.setattr(engine, "settings", settings)
    got = post(openai_server, "/v1/responses", body).json()
    assert [item["type"] for item in got["output"]] == ["reasoning"]
    assert got["output"][0]["content"] == [{"text": plain, "type": "reasoning_text"}]
    assert got["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    events = _named_events(post(openai_server, "/v1/responses", {**body, "stream": True}).body)
    deltas = [data["delta"] for name, data in events if name == "response.reasoning_text.delta"]
    assert "".join(deltas) == plain
    assert not any(name == "response.output_text.delta" for name, _ in events)
    hidden = post(openai_server, "/v1/responses", {**body, "include_reasoning": False}).json()
    assert hidden["output"] == []


def test_chat_fields_reach_the_answer(openai_server, engine):
    # stop, seed and the rest are chat's sampling fields, honoured as there.
    body = _body(input="Count from one to ten.", max_output_tokens=30)
    full = post(openai_server, "/v1/responses", body).json()["output"][0]["content"][0]["text"]
    word = full.split()[2]
    stopped = post(openai_server, "/v1/responses", {**body, "stop": [word]}).json()
    assert stopped["output"][0]["content"][0]["text"] == full[: full.index(word)]
    assert stopped["status"] == "completed"
    # The echoed max_output_tokens is what the request may produce (vLLM's).
    assert stopped["max_output_tokens"] == 30
    # Not given: the room the context leaves (stopped early here by its first space).
    unbounded = post(openai_server, "/v1/responses", _body(input="Hi", stop=[" ", "e", "o"]))
    got = unbounded.json()
    settings = engine.settings
    room = settings.max_model_len - got["usage"]["input_tokens"]
    assert got["max_output_tokens"] == min(room, settings.max_new_tokens_cap or room)


def test_ids_include_and_empty_instructions(openai_server):
    got = post(
        openai_server,
        "/v1/responses",
        _body(
            input="Hi",
            max_output_tokens=2,
            request_id="mine-1",
            include=["reasoning.encrypted_content"],
        ),
    ).json()
    assert got["id"] == "mine-1"  # a given request_id is the response's id, as in vLLM
    blank = _body(input="Hi", max_output_tokens=6, instructions="")
    assert post(openai_server, "/v1/responses", blank).json()["instructions"] == ""
    assert (
        post(openai_server, "/v1/responses", blank).json()["output"][0]["content"][0]["text"]
        == post(openai_server, "/v1/responses", _body(input="Hi", max_output_tokens=6)).json()[
            "output"
        ][0]["content"][0]["text"]
    )  # an empty system message is not added: the template's default stays


def test_an_unfinished_assistant_message_is_continued(openai_server):
    start = "The capital of France is"
    body = _body(
        input=[
            {"role": "user", "content": "Tell me about France."},
            {"role": "assistant", "content": start, "status": "incomplete"},
        ],
        max_output_tokens=4,
    )
    got = post(openai_server, "/v1/responses", body).json()
    reply = client(openai_server).chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Tell me about France."},
            {"role": "assistant", "content": start},
        ],
        max_tokens=4,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert got["output"][0]["content"][0]["text"] == reply.choices[0].message.content


def test_a_schema_that_cannot_be_compiled_names_text_format(openai_server):
    text = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "nonsense"}}}
    reply = post(openai_server, "/v1/responses", _body(input="x", text=text))
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["param"] == "text.format"


def test_echoed_fields_come_back_as_vllm_repeats_them(openai_server):
    got = post(
        openai_server,
        "/v1/responses",
        _body(
            input="Hi",
            max_output_tokens=1,
            metadata={"team": "a"},
            user="u1",
            reasoning={"effort": "low"},
            text={"format": {"type": "text"}},
            parallel_tool_calls=None,
        ),
    ).json()
    assert got["metadata"] == {"team": "a"} and got["user"] == "u1"
    assert got["reasoning"] == {
        "context": None, "effort": "low", "generate_summary": None, "mode": None, "summary": None
    }  # fmt: skip
    assert got["text"] == {"format": {"type": "text"}, "verbosity": None}
    assert got["parallel_tool_calls"] is True
