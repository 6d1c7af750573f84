"""/v1/completions' prompt_embeds over real HTTP with the official client: base64
torch.save tensors, alone, several, beside text prompts, streamed, truncated; the engine's
own embedding of a text's tokens answers as the text does. Every bad payload is a 400
naming prompt_embeds, and a server without --enable-prompt-embeds refuses them by name.
"""

from __future__ import annotations

import base64
import io

import pytest
import torch

from aioserve.server.state import ServerState
from tests.engine.smollm2 import float32_engine
from tests.server.conftest import MODEL, openai_app, serve_app
from tests.server.openai_helpers import client, post

TEXT = "The river that runs through the old town floods every spring"


def encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def embeds_engine(smollm2_gguf, server_loop):
    engine = float32_engine(smollm2_gguf, max_model_len=512, enable_prompt_embeds=True)
    yield engine
    server_loop.run(engine.shutdown())


@pytest.fixture(scope="module")
def url(embeds_engine, server_loop):
    with serve_app(server_loop, openai_app(ServerState(embeds_engine, [MODEL]))) as base:
        yield base


@pytest.fixture(scope="module")
def text_embeds(embeds_engine) -> tuple[list[int], torch.Tensor]:
    """TEXT's token ids, and their rows in the engine's embedding table."""
    ids = embeds_engine.tokenizer(TEXT).input_ids
    return ids, embeds_engine.runner.model.embed_tokens.weight[ids].detach().clone()


def _complete(url: str, **fields):
    return client(url).completions.create(
        model=MODEL, max_tokens=8, temperature=0.0, **fields
    )  # fmt: skip


def test_the_embedding_of_a_texts_tokens_answers_as_the_text(url, text_embeds):
    ids, rows = text_embeds
    by_text = _complete(url, prompt=TEXT)
    by_rows = _complete(url, prompt="", extra_body={"prompt_embeds": encoded(rows)})
    assert by_rows.choices[0].text == by_text.choices[0].text
    assert by_rows.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    # bfloat16 rows are taken too: cast to the model's dtype.
    half = _complete(url, prompt="", extra_body={"prompt_embeds": encoded(rows.bfloat16())})
    assert half.usage.prompt_tokens == len(ids)


def test_several_embeddings_come_first_then_the_text_prompts(url, text_embeds):
    _, rows = text_embeds
    other = rows[:5].clone()
    reply = _complete(
        url,
        prompt=[TEXT],
        extra_body={"prompt_embeds": [encoded(other), encoded(rows)], "return_token_ids": True},
    )
    alone = [
        _complete(url, prompt="", extra_body={"prompt_embeds": encoded(other)}).choices[0].text,
        _complete(url, prompt="", extra_body={"prompt_embeds": encoded(rows)}).choices[0].text,
        _complete(url, prompt=TEXT).choices[0].text,
    ]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == alone
    # A prompt of embeddings has no token ids to show.
    shown = [c.model_extra["prompt_token_ids"] for c in reply.choices]
    assert shown[0] is None and shown[1] is None and shown[2] is not None


def test_a_stream_of_a_prompt_of_embeddings(url, text_embeds):
    _, rows = text_embeds
    stream = _complete(
        url,
        prompt="",
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"prompt_embeds": encoded(rows)},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _complete(url, prompt=TEXT).choices[0].text
    assert chunks[-1].usage.prompt_tokens == rows.shape[0]


def test_truncation_keeps_the_last_rows(url, text_embeds):
    ids, rows = text_embeds
    cut = _complete(
        url,
        prompt="",
        extra_body={"prompt_embeds": encoded(rows), "truncate_prompt_tokens": 5},
    )
    assert cut.usage.prompt_tokens == 5
    tail = _complete(url, prompt="", extra_body={"prompt_embeds": encoded(rows[-5:])})
    assert cut.choices[0].text == tail.choices[0].text


def _not_a_tensor() -> str:
    buffer = io.BytesIO()
    torch.save({"rows": [1, 2]}, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "not valid base64"),
        (
            {"prompt_embeds": base64.b64encode(b"junk").decode()},
            "prompt_embeds",
            "could not be deserialized as a torch tensor",
        ),
        ({"prompt_embeds": "NOT_A_TENSOR"}, "prompt_embeds", "must hold a tensor, not a dict"),
        ({"prompt_embeds": 5}, "prompt_embeds", "base64 string or an array"),
        ({"prompt_embeds": ["ok", 3]}, "prompt_embeds", "base64 string or an array"),
        ({"prompt_embeds": "VEC"}, "prompt_embeds", "must be a 2D tensor"),
        ({"prompt_embeds": "NARROW"}, "prompt_embeds", "hidden_size 8 does not match"),
        ({"prompt_embeds": "INTS"}, "prompt_embeds", "not a floating-point type"),
        ({"prompt_embeds": "ROWS", "echo": True}, None, "Echo is unsupported with prompt embeds"),
        ({"prompt_embeds": "ROWS", "prompt_logprobs": 1}, None, "prompt_logprobs is not"),
        ({"prompt": ""}, "prompt", "Either prompt or prompt_embeds must be provided"),
        ({}, "prompt", "Either prompt or prompt_embeds must be provided"),
    ],
)
def test_bad_payloads_are_400s(url, embeds_engine, fields, param, words):
    hidden = embeds_engine.settings.hidden_size
    payloads = {
        "NOT_A_TENSOR": _not_a_tensor(),
        "VEC": encoded(torch.zeros(hidden)),
        "NARROW": encoded(torch.zeros(4, 8)),
        "INTS": encoded(torch.zeros(4, hidden, dtype=torch.int32)),
        "ROWS": encoded(torch.zeros(4, hidden)),
    }
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if isinstance(body.get("prompt_embeds"), str):
        body["prompt_embeds"] = payloads.get(body["prompt_embeds"], body["prompt_embeds"])
    reply = post(url, "/v1/completions", body)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert words in error["message"]
    assert error["param"] == param


def test_a_server_without_the_flag_refuses_them_by_name(openai_server):
    rows = torch.zeros(4, 576)
    reply = post(openai_server, "/v1/completions", {"prompt_embeds": encoded(rows)})
    assert reply.status == 400
    assert "You must set `--enable-prompt-embeds`" in reply.json()["error"]["message"]
