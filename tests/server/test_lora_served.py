"""LoRA adapters served for real: `python -m aioserve serve --enable-lora --lora-modules ...`
on a tiny random Llama, started once for the module, against PEFT and vLLM 0.32's answers.

References: PEFT on transformers with the same adapters (greedy tokens), and vLLM's answers
serving SmolLM2 with adapters (vllm_samples/170-209): the model list, the responses' model
names, and the load/unload routes' statuses and words.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from aiohttp import web

from tests.lora_adapters import make_lora_adapter, peft_reference
from tests.server.openai_helpers import client, post, sample, sample_stream, shape, sse_events
from tests.server.serve_process import fetch, read_metrics, serve_model

MODEL = "smollm2"
"""The name vLLM served the base model under in the recorded samples."""
PROMPT = "The capital of France is"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_lora_adapter(tiny_model, folder / "sql", rank=8, alpha=16, seed=1),
        "chat": make_lora_adapter(
            tiny_model, folder / "chat", rank=4, alpha=8, targets=("q_proj", "v_proj"),
            seed=2, use_rslora=True,
        ),
        "big": make_lora_adapter(tiny_model, folder / "big", rank=16, alpha=16, seed=3),
    }  # fmt: skip


@pytest.fixture(scope="module")
def lora_server(tiny_model, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-lora") / "serve.log"
    options = ["--dtype", "float32", "--max-model-len", "512", "--enable-lora"]
    options += ["--max-loras", "2", "--max-lora-rank", "8", "--lora-modules"]
    options += [f"sql={adapters['sql']}", f'{{"name": "chat", "path": "{adapters["chat"]}"}}']
    environment = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with serve_model(tiny_model, MODEL, log, *options, env=environment) as url:
        yield url


@pytest.fixture(scope="module")
def peft_tokens(tiny_model, adapters):
    """name -> PEFT's greedy tokens after the prompt (None: the base model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(tiny_model)(PROMPT, return_tensors="pt").input_ids
    tokens = {}
    for name in (None, "sql", "chat"):
        if name is None:
            model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        else:
            model = peft_reference(tiny_model, adapters[name])
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens[name] = out[0, prompt.shape[1] :].tolist()
    return tokens


def _body(name: str) -> Any:
    return sample(name)["response"]["body"]


def _completion(url: str, model: str) -> dict:
    reply = post(
        url,
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert reply.status == 200, reply.body
    return reply.json()


def test_models_lists_each_adapter_under_the_base_model(lora_server, adapters):
    reply = fetch("GET", lora_server + "/v1/models")
    cards = reply.json()["data"]
    recorded = _body("170_models_lora")["data"]
    assert [c["id"] for c in cards] == [c["id"] for c in recorded] == [MODEL, "sql", "chat"]
    assert shape(cards) == shape(recorded)
    for card, name in zip(cards[1:], ("sql", "chat"), strict=True):
        assert (card["root"], card["parent"], card["max_model_len"]) == (
            adapters[name],
            MODEL,
            None,
        )


@pytest.mark.parametrize("model", [MODEL, "sql", "chat"])
def test_each_model_name_generates_as_peft_does(lora_server, peft_tokens, model):
    body = _completion(lora_server, model)
    assert body["model"] == model  # vLLM's answers say the adapter's name (sample 171)
    assert body["choices"][0]["token_ids"] == peft_tokens[None if model == MODEL else model]


def test_the_adapters_differ_from_the_base_model(peft_tokens):
    """Else the test above could not tell an adapter from the base model."""
    assert len({tuple(t) for t in peft_tokens.values()}) == 3


def test_chat_streams_under_the_adapters_name(lora_server):
    with client(lora_server) as openai:
        stream = openai.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        models = {chunk.model for chunk in stream}
    assert models == {"chat"}
    recorded = sse_events(sample_stream("175_chat_stream_lora_chat"))
    assert {event["model"] for event in recorded} == {"chat"}


def test_an_unknown_adapter_is_a_404(lora_server):
    reply = post(lora_server, "/v1/completions", {"model": "no-such-adapter", "prompt": PROMPT})
    recorded = _body("176_err_unknown_model_lora")
    assert reply.status == 404
    assert shape(reply.json()) == shape(recorded)
    assert reply.json()["error"]["message"].startswith(
        "The model `no-such-adapter` does not exist."
    )


def test_adapters_load_and_unload_at_run_time(lora_server, adapters, peft_tokens):
    load = {"lora_name": "sql2", "lora_path": adapters["sql"]}
    reply = post(lora_server, "/v1/load_lora_adapter", load)
    assert (reply.status, reply.body.decode()) == (200, _body("177_load_lora_adapter"))
    assert _completion(lora_server, "sql2")["choices"][0]["token_ids"] == peft_tokens["sql"]
    reply = post(lora_server, "/v1/load_lora_adapter", load)
    assert (reply.status, reply.json()) == (400, _body("178_err_load_lora_duplicate"))
    # In place: sql2 is now the chat adapter.
    reply = post(
        lora_server,
        "/v1/load_lora_adapter",
        {"lora_name": "sql2", "lora_path": adapters["chat"], "load_inplace": True},
    )
    assert reply.status == 200
    assert _completion(lora_server, "sql2")["choices"][0]["token_ids"] == peft_tokens["chat"]
    ids = [c["id"] for c in fetch("GET", lora_server + "/v1/models").json()["data"]]
    assert ids == [MODEL, "sql", "chat", "sql2"]

    reply = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert (reply.status, reply.body.decode()) == (200, _body("187_unload_lora_adapter"))
    reply = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert (reply.status, reply.json()) == (404, _body("188_err_unload_lora_unknown"))
    ids = [c["id"] for c in fetch("GET", lora_server + "/v1/models").json()["data"]]
    assert ids == [MODEL, "sql", "chat"]
    reply = post(lora_server, "/v1/completions", {"model": "sql2", "prompt": PROMPT})
    assert reply.status == 404


@pytest.mark.parametrize(
    ("body", "status", "recorded"),
    [
        ({"lora_name": "x"}, 400, "179_err_load_lora_missing_path"),
        ({"lora_path": "/x"}, 400, "184_err_load_lora_missing_name"),
        ({"lora_name": MODEL, "lora_path": "/x"}, 400, "199_err_load_lora_base_name"),
        ({"lora_name": "", "lora_path": "/x"}, 400, "200_err_load_lora_empty_name"),
        ({"lora_name": "ghost", "lora_path": "/no/such/adapter"}, 404, "180_err_load_lora_path_not_found"),
    ],
)  # fmt: skip
def test_refused_loads_answer_as_vllm(lora_server, body, status, recorded):
    reply = post(lora_server, "/v1/load_lora_adapter", body)
    expected = _body(recorded)["error"]
    error = reply.json()["error"]
    assert reply.status == status == expected["code"]
    assert (error["type"], error["param"]) == (expected["type"], expected["param"])
    if "<path>" in expected["message"]:
        assert error["message"] == expected["message"].replace("<path>", body["lora_path"])
    elif "validation error" in expected["message"]:
        assert error["message"].startswith(expected["message"].split(", 'input'")[0])
    else:
        assert error["message"] == expected["message"]


def test_an_adapter_above_max_lora_rank_is_refused_with_vllms_reason(lora_server, adapters):
    reply = post(
        lora_server, "/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["big"]}
    )
    assert reply.status == 400  # vLLM: 500 (181), for an adapter that is the user's fault
    assert reply.json()["error"]["message"] == (
        "Loading lora big failed: LoRA rank 16 is greater than max_lora_rank 8."
    )
    names = [c["id"] for c in fetch("GET", lora_server + "/v1/models").json()["data"]]
    assert "big" not in names


def test_metrics_report_the_adapters_in_flight(lora_server):
    _completion(lora_server, "chat")
    samples = [s for s in read_metrics(lora_server) if s.name == "vllm:lora_requests_info"]
    assert {s.labels["max_lora"] for s in samples} == {"2"}
    assert {"chat"} <= {s.labels["running_lora_adapters"] for s in samples}
    assert all(s.value > 1.7e9 for s in samples)  # when each combination was last seen


@pytest.mark.parametrize(
    ("setting", "served"), [("True", True), ("1", True), ("0", False), (None, False)]
)
def test_the_runtime_routes_exist_only_when_the_environment_allows(monkeypatch, setting, served):
    from aioserve.server.lora_routes import add_lora_routes

    if setting is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", setting)
    app = web.Application()
    add_lora_routes(app)
    paths = {route.resource.canonical for route in app.router.routes()}
    assert ({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths) is served


def test_tokenize_takes_an_adapters_name(lora_server):
    """vLLM tokenizes with the base model's tokenizer under an adapter's name (sample 207)."""
    base = post(lora_server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    adapted = post(lora_server, "/tokenize", {"model": "sql", "prompt": PROMPT})
    recorded = _body("207_tokenize_lora_sql")
    assert adapted.status == base.status == 200
    assert adapted.json()["tokens"] == base.json()["tokens"] == recorded["tokens"]


def test_responses_run_through_an_adapter(lora_server):
    with client(lora_server) as openai:
        response = openai.responses.create(
            model="sql", input="What is the capital of France?", max_output_tokens=4
        )
    assert response.model == "sql"
    assert response.usage.output_tokens == 4  # cut by max_output_tokens: "incomplete"


def test_openapi_documents_the_runtime_routes_and_adapter_cards(lora_server):
    document = fetch("GET", lora_server + "/openapi.json").json()
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(document["paths"])
    card = document["components"]["schemas"]["ModelList"]["properties"]["data"]["items"]
    assert card["properties"]["parent"] == {"type": ["string", "null"]}
