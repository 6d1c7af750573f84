"""The whole app (build_app) in-process over real HTTP: routes, middlewares, error statuses.

Each test serves an app built from `aioserve serve`-style arguments on 127.0.0.1 (a free
port), on the engine's event loop (conftest's `server_loop`), and talks to it from this
thread with aiohttp's client or the official `openai` client. References: vLLM's recorded
responses (shared/reference/vllm_samples; the values used are copied below), transformers'
tokenizer and chat template, and hand-computed values.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import ssl
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from multidict import CIMultiDict

from aioserve import __version__
from aioserve.config.declaration import ConfigError
from aioserve.config.frontend import frontend_config_from_args
from aioserve.config.parser import build_engine_parser
from aioserve.log_setup import ACCESS_LOGGER
from aioserve.server.app import build_app
from aioserve.server.middlewares import MAX_REQUEST_BODY_BYTES
from aioserve.server.serve import build_ssl_context, make_runner
from aioserve.server.state import ServerState
from tests.server.conftest import MODEL, wait_until_idle
from tests.server.openai_helpers import send_oversized_head

pytestmark = pytest.mark.slow

ALIAS = "smol"
TIMEOUT = aiohttp.ClientTimeout(total=120)

# vLLM 0.32 on the same model (vllm_samples 11, 12, 13 and 01).
VLLM_HELLO_WORLD = [19556, 905]
VLLM_CHAT_TOKENS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
    407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
    520, 9531, 198,
]  # fmt: skip
VLLM_MODEL_CARD_KEYS = {
    "id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission",
}  # fmt: skip
CAPITAL_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The OpenAI error object, checked for its shape."""
        body = self.json()
        assert set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == self.status
        return body["error"]


def fetch(method: str, url: str, **kwargs: Any) -> Reply:
    """One HTTP request from this thread (its own event loop), the whole body read."""

    async def go() -> Reply:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
            async with session.request(method, url, **kwargs) as response:
                return Reply(response.status, CIMultiDict(response.headers), await response.read())

    return asyncio.run(go())


@dataclass
class Served:
    url: str
    state: ServerState
    app: web.Application


@contextmanager
def serve(server_loop, engine, *argv: str) -> Iterator[Served]:
    """The app for `aioserve serve <argv>` on a free port of 127.0.0.1, runner as in serve."""
    options = frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))
    state = ServerState(engine, [MODEL, ALIAS], options)
    app = build_app(state)

    async def start() -> web.AppRunner:
        runner = make_runner(app, state.frontend)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return runner

    runner = server_loop.run(start())
    host, port = runner.addresses[0][:2]
    try:
        yield Served(f"http://{host}:{port}", state, app)
    finally:
        server_loop.run(runner.cleanup())


@pytest.fixture(autouse=True)
def _no_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


@pytest.fixture
def server(server_loop, engine) -> Iterator[Served]:
    with serve(server_loop, engine) as served:
        yield served


# --- routes --------------------------------------------------------------------------------


def test_models_lists_every_served_name_in_vllms_shape(server, engine):
    reply = fetch("GET", server.url + "/v1/models")
    assert reply.status == 200
    body = reply.json()
    assert body["object"] == "list"
    assert [card["id"] for card in body["data"]] == [MODEL, ALIAS]
    for card in body["data"]:
        assert set(card) == VLLM_MODEL_CARD_KEYS
        assert card["object"] == "model"
        assert card["max_model_len"] == engine.settings.max_model_len == 2048
        assert card["permission"][0]["object"] == "model_permission"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [model.id for model in client.models.list()] == [MODEL, ALIAS]


def test_probes_and_version(server):
    for method, path in [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")]:
        reply = fetch(method, server.url + path)
        assert (reply.status, reply.body) == (200, b"")
    assert fetch("HEAD", server.url + "/health").status == 200
    reply = fetch("GET", server.url + "/version")
    assert reply.json() == {"version": __version__}


def test_tokenize_a_prompt_as_vllm_and_transformers_do(server, hf_tokenizer):
    reply = fetch("POST", server.url + "/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert reply.json() == {
        "count": 2,
        "max_model_len": 2048,
        "tokens": VLLM_HELLO_WORLD,
        "token_strs": None,
    }
    text = "Déjà vu: naïve café owners, 12345 times — 東京!"
    reply = fetch(
        "POST", server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}
    )
    expected = hf_tokenizer(text).input_ids
    body = reply.json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(expected)
    words = fetch(
        "POST", server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    )
    assert words.json()["token_strs"] == ["Hello", "Ġworld"]


def test_tokenize_messages_with_the_chat_template(server, hf_tokenizer):
    reply = fetch(
        "POST",
        server.url + "/tokenize",
        json={"model": ALIAS, "messages": CAPITAL_QUESTION, "add_generation_prompt": True},
    )
    assert reply.json()["tokens"] == VLLM_CHAT_TOKENS and reply.json()["count"] == 37
    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            CAPITAL_QUESTION,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=True,
        )["input_ids"]
        body = {"messages": CAPITAL_QUESTION, "add_generation_prompt": add_generation_prompt}
        reply = fetch("POST", server.url + "/tokenize", json=body)
        assert reply.json()["tokens"] == expected
        assert reply.json()["count"] == len(expected)
    assert expected == VLLM_CHAT_TOKENS[:-4]  # without "<|im_start|>assistant\n"


def test_a_prompt_being_tokenized_does_not_stall_the_loop(server, engine, monkeypatch):
    # The tokenizer is held inside a completion request until /health has been answered:
    # on the event loop, that would never happen.
    entered, release = threading.Event(), threading.Event()
    tokenize_prompt = engine.tokenize_prompt
    tokenized_on = []

    def held_tokenize(prompt):
        if isinstance(prompt, str):  # the engine's own call gets the handler's token ids
            tokenized_on.append(threading.current_thread())
            entered.set()
            assert release.wait(timeout=60)
        return tokenize_prompt(prompt)

    monkeypatch.setattr(engine, "tokenize_prompt", held_tokenize)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        completion = pool.submit(fetch, "POST", server.url + "/v1/completions", json=body)
        assert entered.wait(timeout=60)
        health = fetch("GET", server.url + "/health")
        release.set()
        assert completion.result(timeout=120).status == 200
    assert health.status == 200
    assert [t.name for t in tokenized_on] == ["aioserve-text_0"]


def test_detokenize_round_trip(server):
    reply = fetch(
        "POST", server.url + "/detokenize", json={"model": MODEL, "tokens": VLLM_HELLO_WORLD}
    )
    assert reply.json() == {"prompt": "Hello world"}
    text = "Déjà vu: naïve café owners — 東京!\n  indented"
    tokens = fetch("POST", server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
    reply = fetch("POST", server.url + "/detokenize", json={"tokens": tokens})
    assert reply.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": "19556"}, 400, "tokens"),
        ("/detokenize", {"tokens": [19556, True]}, 400, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ],
)
def test_bad_tokenize_requests_are_refused_by_field(server, path, body, status, param):
    reply = fetch("POST", server.url + path, json=body)
    assert reply.status == status
    assert reply.error()["param"] == param


def test_body_that_is_not_json_is_a_400(server):
    reply = fetch(
        "POST",
        server.url + "/tokenize",
        data=b'{"prompt": ',
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 400
    assert "not valid JSON" in reply.error()["message"]
    assert fetch("GET", server.url + "/health").status == 200


# --- error statuses ------------------------------------------------------------------------


def test_unknown_route_is_a_404_and_wrong_method_a_405(server):
    reply = fetch("GET", server.url + "/v1/nope")
    assert reply.status == 404
    error = reply.error()
    assert error["type"] == "NotFoundError" and "/v1/nope" in error["message"]
    reply = fetch("GET", server.url + "/v1/completions")
    assert reply.status == 405
    assert reply.headers["Allow"] == "POST"
    assert "GET /v1/completions" in reply.error()["message"]
    assert fetch("DELETE", server.url + "/tokenize").status == 405


def test_body_over_the_limit_is_a_413(server):
    answer = send_oversized_head(server.url, "/tokenize", MAX_REQUEST_BODY_BYTES)
    assert answer.status == 413
    reply = Reply(413, CIMultiDict(), answer.body)
    assert str(MAX_REQUEST_BODY_BYTES) in reply.error()["message"]
    assert fetch("GET", server.url + "/health").status == 200


def test_only_json_bodies_are_read_as_vllm_reads_them(server):
    """vLLM's routes take application/json alone (api_utils.validate_json_request): curl's
    default form type, text/plain or no type at all is a 400."""
    body = json.dumps({"prompt": "Hello world"}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        for path in ("/tokenize", "/v1/completions", "/v1/chat/completions"):
            reply = fetch("POST", server.url + path, data=body, headers=headers)
            assert reply.status == 400, (content_type, path)
            message = reply.error()["message"]
            assert message == "Unsupported Media Type: Only 'application/json' is allowed"
    typed = {"Content-Type": "Application/JSON; charset=utf-8"}
    reply = fetch("POST", server.url + "/tokenize", data=body, headers=typed)
    assert reply.status == 200 and reply.json()["tokens"] == VLLM_HELLO_WORLD


def test_long_and_many_headers_get_through_as_they_do_to_vllm(server):
    """uvicorn's h11 takes 4 MiB of head and 256 headers; aiohttp's defaults (8 KiB a line,
    128 headers) refused what vLLM serves."""
    assert fetch("GET", server.url + "/health", headers={"X-Big": "a" * 9000}).status == 200
    many = {f"X-Trace-{i}": "x" for i in range(200)}
    assert fetch("GET", server.url + "/health", headers=many).status == 200


def test_api_key_protects_the_v1_routes(server_loop, engine):
    with serve(server_loop, engine, "--api-key", "s3cret") as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as error:
            client.models.list()
        assert error.value.status_code == 401
        reply = fetch("GET", served.url + "/v1/models")
        assert reply.status == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.error()["type"] == "AuthenticationError"
        for header in ("Basic s3cret", "s3cret", "Bearer s3cret2", "Bearer"):
            assert (
                fetch("GET", served.url + "/v1/models", headers={"Authorization": header}).status
                == 401
            )
        # vLLM reads the key as exactly what follows "Bearer ".
        assert fetch("GET", served.url + "/v1/models",
                     headers={"Authorization": "Bearer  s3cret"}).status == 401  # fmt: skip
        # Unknown /v1 routes are protected too; the rest of the server is not.
        assert fetch("GET", served.url + "/v1/nope").status == 401
        assert fetch("GET", served.url + "/health").status == 200
        assert fetch("POST", served.url + "/tokenize", json={"prompt": "a"}).status == 200
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="s3cret", max_retries=0)
        assert [model.id for model in client.models.list()] == [MODEL, ALIAS]


def test_any_of_several_api_keys_is_accepted(server_loop, engine, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")  # the flag wins over the variable
    with serve(server_loop, engine, "--api-key", "first", "second") as served:
        for key, status in [("first", 200), ("second", 200), ("from-env", 401), ("third", 401)]:
            headers = {"Authorization": f"Bearer {key}"}
            assert fetch("GET", served.url + "/v1/models", headers=headers).status == status


def test_vllm_api_key_environment_variable_works_like_the_flag(server_loop, engine, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    with serve(server_loop, engine) as served:
        assert fetch("GET", served.url + "/v1/models").status == 401
        reply = fetch(
            "GET", served.url + "/v1/models", headers={"Authorization": "Bearer from-env"}
        )
        assert reply.status == 200


def test_draining_server_answers_503_but_keeps_serving_metrics(server):
    server.state.draining = True
    for method, path in [("GET", "/v1/models"), ("GET", "/health"), ("POST", "/tokenize")]:
        reply = fetch(method, server.url + path, json={"prompt": "a"})
        assert reply.status == 503
        assert reply.error()["type"] == "ServiceUnavailableError"
    assert fetch("GET", server.url + "/metrics").status == 200


# --- CORS, request ids, load tracking -----------------------------------------------------


def _preflight(url: str, origin: str, method: str = "POST", headers: str = "content-type"):
    return fetch(
        "OPTIONS",
        url + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": method,
            "Access-Control-Request-Headers": headers,
        },
    )


def test_cors_is_off_by_default_and_any_origin_when_asked(server, server_loop, engine):
    """vLLM 0.32's --allowed-origins defaults to none: "Cross-origin browser access is
    disabled by default" (launchers/cli_args.py)."""
    assert _preflight(server.url, "https://app.example").status == 400
    reply = fetch("GET", server.url + "/v1/models", headers={"Origin": "https://app.example"})
    assert reply.status == 200 and "Access-Control-Allow-Origin" not in reply.headers
    with serve(server_loop, engine, "--allowed-origins", '["*"]') as served:
        reply = _preflight(served.url, "https://app.example", headers="authorization, content-type")
        assert reply.status == 200
        assert reply.headers["Access-Control-Allow-Origin"] == "*"
        assert "POST" in reply.headers["Access-Control-Allow-Methods"]
        assert reply.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        reply = fetch("GET", served.url + "/v1/models", headers={"Origin": "https://app.example"})
        assert reply.headers["Access-Control-Allow-Origin"] == "*"
        assert "Access-Control-Allow-Origin" not in fetch("GET", served.url + "/v1/models").headers


def test_cors_with_listed_origins_methods_headers_and_credentials(server_loop, engine):
    argv = [
        "--allowed-origins", '["https://good.example"]',
        "--allowed-methods", '["POST"]',
        "--allowed-headers", '["Authorization"]',
        "--allow-credentials",
        "--api-key", "k",
    ]  # fmt: skip
    with serve(server_loop, engine, *argv) as served:
        good = "https://good.example"
        reply = _preflight(served.url, good, headers="authorization")
        assert reply.status == 200  # preflight needs no API key
        assert reply.headers["Access-Control-Allow-Origin"] == good
        assert reply.headers["Access-Control-Allow-Credentials"] == "true"
        assert reply.headers["Access-Control-Allow-Methods"] == "POST"
        assert "authorization" in reply.headers["Access-Control-Allow-Headers"]
        assert _preflight(served.url, "https://evil.example").status == 400
        assert _preflight(served.url, good, method="PUT").status == 400
        assert _preflight(served.url, good, headers="x-secret").status == 400
        # Errors carry the CORS headers too, so that the browser shows them.
        reply = fetch("GET", served.url + "/v1/models", headers={"Origin": good})
        assert reply.status == 401
        assert reply.headers["Access-Control-Allow-Origin"] == good
        reply = fetch("GET", served.url + "/v1/models", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in reply.headers


def test_request_id_headers_and_load_tracking_on_a_stream(server_loop, engine):
    argv = ["--enable-request-id-headers", "--enable-server-load-tracking"]
    with serve(server_loop, engine, *argv) as served:
        assert fetch("GET", served.url + "/health").headers["X-Request-Id"]
        generated = {fetch("GET", served.url + "/health").headers["X-Request-Id"] for _ in range(2)}
        assert len(generated) == 2 and all(re.fullmatch(r"[0-9a-f]{32}", g) for g in generated)
        assert fetch("GET", served.url + "/load").json() == {"server_load": 0}

        async def stream() -> tuple[str, int, list[bytes]]:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async with session.post(
                    served.url + "/v1/completions", json=body, headers={"X-Request-Id": "mine-1"}
                ) as response:
                    first = await response.content.readline()
                    async with session.get(served.url + "/load") as load:
                        in_flight = (await load.json())["server_load"]
                    rest = [line async for line in response.content]
                    return response.headers["X-Request-Id"], in_flight, [first, *rest]

        request_id, in_flight, lines = asyncio.run(stream())
        assert request_id == "mine-1"
        assert in_flight == 1
        assert lines[0].startswith(b"data: ") and b"data: [DONE]\n" in lines
        wait_until_idle(engine, server_loop)
    with serve(server_loop, engine) as served:
        assert "X-Request-Id" not in fetch("GET", served.url + "/health").headers
        # vLLM serves /load without tracking too, and answers 0.
        assert fetch("GET", served.url + "/load").json() == {"server_load": 0}


# --- OpenAPI, docs, root path ------------------------------------------------------------------


def test_openapi_lists_every_route(server):
    document = fetch("GET", server.url + "/openapi.json").json()
    assert document["openapi"].startswith("3.")
    routes = {
        (route.method.lower(), route.resource.canonical)
        for route in server.app.router.routes()
        if route.method != "HEAD" and route.resource.canonical not in ("/openapi.json", "/docs")
    }
    listed = {(method, path) for path, ops in document["paths"].items() for method in ops}
    assert routes == listed
    assert ("post", "/v1/chat/completions") in listed and ("get", "/metrics") in listed
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert operation["summary"] and "200" in operation["responses"], (method, path)
            if method == "post" and path not in ("/ping", "/v1/responses/{response_id}/cancel"):
                schema = operation["requestBody"]["content"]["application/json"]["schema"]
                for ref in schema.get("oneOf", [schema]):  # /invocations takes several
                    name = ref["$ref"].rpartition("/")[2]
                    assert document["components"]["schemas"][name]["properties"]
    docs = fetch("GET", server.url + "/docs")
    assert docs.status == 200 and docs.headers["Content-Type"].startswith("text/html")
    assert b'fetch("/openapi.json")' in docs.body


def test_root_path_serves_every_route_under_the_prefix_too(server_loop, engine):
    with serve(server_loop, engine, "--root-path", "/api/", "--api-key", "k") as served:
        for prefix in ("", "/api"):
            assert fetch("GET", served.url + prefix + "/health").status == 200
            assert fetch("GET", served.url + prefix + "/v1/models").status == 401
        assert fetch("GET", served.url + "/api/openapi.json").json()["servers"] == [{"url": "/api"}]
        assert b'fetch("/api/openapi.json")' in fetch("GET", served.url + "/api/docs").body


# --- logs, --middleware, TLS -------------------------------------------------------------------


def test_request_log_lines_are_cut_to_max_log_len(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger="aioserve.server")
    argv = ["--enable-log-requests", "--max-log-len", "13"]
    with serve(server_loop, engine, *argv) as served:
        fetch("POST", served.url + "/tokenize", json={"prompt": "A long prompt that is cut"})
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("Received request")
    ]
    assert len(lines) == 1
    assert lines[0].endswith('POST /tokenize from 127.0.0.1: {"prompt": "A... (39 characters)')
    caplog.clear()
    with serve(server_loop, engine, "--max-log-len", "13") as served:
        fetch("POST", served.url + "/tokenize", json={"prompt": "x"})
    assert not [r for r in caplog.records if r.getMessage().startswith("Received request")]


def test_access_log_has_a_line_per_request_unless_disabled(server_loop, engine, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    with serve(server_loop, engine) as served:
        fetch("GET", served.url + "/version")
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert len(lines) == 1 and re.match(r'127\.0\.0\.1 "GET /version HTTP/1\.1" 200 ', lines[0])
    caplog.clear()
    with serve(server_loop, engine, "--disable-uvicorn-access-log") as served:
        fetch("GET", served.url + "/version")
    assert not [r for r in caplog.records if r.name == ACCESS_LOGGER]


async def tag_middleware(request: web.Request, handler) -> web.StreamResponse:
    """A user middleware for --middleware (imported by its path)."""
    response = await handler(request)
    response.headers["X-Tag"] = f"seen {request.path}"
    return response


def test_user_middleware_from_its_import_path(server_loop, engine):
    with serve(server_loop, engine, "--middleware", f"{__name__}.tag_middleware") as served:
        assert fetch("GET", served.url + "/version").headers["X-Tag"] == "seen /version"
    with pytest.raises(ConfigError, match=r"^--middleware tests\.nowhere\.mw: cannot import"):
        with serve(server_loop, engine, "--middleware", "tests.nowhere.mw"):
            pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_serves_https(server_loop, engine, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    argv = ["--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    options = frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))
    context = build_ssl_context(options)
    app = build_app(ServerState(engine, [MODEL], options))

    async def start() -> web.AppRunner:
        runner = make_runner(app, options)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context).start()
        return runner

    runner = server_loop.run(start())
    try:
        port = runner.addresses[0][1]
        client_context = ssl.create_default_context(cafile=str(cert))
        reply = fetch("GET", f"https://127.0.0.1:{port}/version", ssl=client_context)
        assert reply.json() == {"version": __version__}
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            fetch("GET", f"https://127.0.0.1:{port}/version")  # not trusted by default
    finally:
        server_loop.run(runner.cleanup())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "need --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "need --ssl-certfile"),
        (["--enable-ssl-refresh"], "need --ssl-certfile"),
        (["--ssl-certfile", "/no/such/cert.pem"], "--ssl-certfile /no/such/cert.pem"),
    ],
)
def test_bad_tls_settings_are_refused_by_name(argv, message):
    options = frontend_config_from_args(build_engine_parser("aioserve serve").parse_args(argv))
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_ssl_context(options)
