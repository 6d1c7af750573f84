"""VLLM_SERVER_DEV_MODE=1's GET /server_info over HTTP: vllm_config (text by default, json on
request) holds the settings the engine resolved and the frontend's; vllm_env the VLLM_*
variables, secret ones left out; system_env the facts collect-env prints; the API key's
value never appears, and it protects the route; another config_format is a 400; without
the variable the route does not exist.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from importlib import metadata

import pytest

from aioserve.platform import current_platform
from tests.server.conftest import MODEL, serve_built
from tests.server.openai_helpers import Reply
from tests.server.serve_process import fetch

pytestmark = pytest.mark.usefixtures("no_api_key_env")
KEYS = {"vllm_config", "vllm_env", "system_env"}


@pytest.fixture
def dev_server(server_loop, engine, monkeypatch) -> Iterator[str]:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with serve_built(server_loop, engine) as url:
        yield url


def _server_info(url: str, query: str = "", key: str | None = None) -> Reply:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return fetch("GET", f"{url}/server_info{query}", headers=headers)


@pytest.mark.parametrize("query", ["", "?config_format=text"])
def test_the_text_form_renders_the_configs(dev_server, engine, query):
    reply = _server_info(dev_server, query)
    assert reply.status == 200, reply.body
    info = reply.json()
    assert set(info) == KEYS
    config = info["vllm_config"]
    assert isinstance(config, str)
    assert config.startswith("EngineSettings(") and "\nFrontendConfig(" in config
    assert f"model_name={engine.settings.model_name!r}" in config
    assert f"max_model_len={engine.settings.max_model_len}" in config
    assert f"served_model_names={engine.settings.served_model_names!r}" in config


def test_the_json_form_holds_the_values_the_engine_runs_with(dev_server, engine):
    reply = _server_info(dev_server, "?config_format=json")
    assert reply.status == 200, reply.body
    info = reply.json()
    assert set(info) == KEYS
    settings, frontend = info["vllm_config"]["engine"], info["vllm_config"]["frontend"]
    assert settings["model_name"] == engine.settings.model_name
    assert settings["max_model_len"] == 2048  # conftest's engine: not the model's 8192
    assert settings["block_size"] == 16 and settings["num_blocks"] == engine.settings.num_blocks
    assert settings["dtype"] == "torch.float32"  # what JSON has no type for: its str
    assert settings["eos_token_ids"] == sorted(engine.settings.eos_token_ids)
    assert frontend["api_key"] is None and frontend["response_role"] == "assistant"
    assert frontend["port"] == 8000 and frontend["max_log_len"] is None


def test_system_env_is_what_collect_env_reports(dev_server):
    system = _server_info(dev_server).json()["system_env"]
    assert system["versions"]["aioserve"] == metadata.version("aioserve")
    assert system["versions"]["python"] == sys.version.split()[0]
    assert system["versions"]["torch"] == metadata.version("torch")
    assert system["platform"] == current_platform()
    assert "VLLM_CPU_KVCACHE_SPACE" in system["environment"]


def test_vllm_env_has_the_variables_but_not_the_secrets(server_loop, engine, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_FOO_TEST", "1")
    monkeypatch.setenv("VLLM_API_KEY", "env-key-value")  # the server's key as well
    monkeypatch.setenv("VLLM_HF_TOKEN", "token-value")
    monkeypatch.setenv("VLLM_DB_PASSWORD", "password-value")
    with serve_built(server_loop, engine) as url:
        assert _server_info(url).status == 401
        for query in ("", "?config_format=json"):
            reply = _server_info(url, query, key="env-key-value")
            assert reply.status == 200, reply.body
            env = reply.json()["vllm_env"]
            assert env["VLLM_FOO_TEST"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
            assert not {"VLLM_API_KEY", "VLLM_HF_TOKEN", "VLLM_DB_PASSWORD"} & set(env)
            for secret in (b"env-key-value", b"token-value", b"password-value"):
                assert secret not in reply.body


def test_the_api_key_protects_the_route_and_never_shows(server_loop, engine, monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with serve_built(server_loop, engine, "--api-key", "cli-key-value") as url:
        refused = _server_info(url)
        assert refused.status == 401 and refused.json()["error"]["code"] == 401
        assert _server_info(url, key="wrong").status == 401
        text = _server_info(url, key="cli-key-value")
        assert text.status == 200 and b"cli-key-value" not in text.body
        assert "api_key='<hidden>'" in text.json()["vllm_config"]
        json_form = _server_info(url, "?config_format=json", key="cli-key-value")
        assert json_form.status == 200 and b"cli-key-value" not in json_form.body
        assert json_form.json()["vllm_config"]["frontend"]["api_key"] == "<hidden>"


@pytest.mark.parametrize("config_format", ["yaml", "JSON", ""])
def test_another_config_format_is_a_400(dev_server, config_format):
    reply = _server_info(dev_server, f"?config_format={config_format}")
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == "config_format"
    assert f"value={config_format})" in error["message"]


def test_the_openapi_document_lists_the_route(dev_server):
    paths = fetch("GET", dev_server + "/openapi.json").json()["paths"]
    assert "get" in paths["/server_info"] and "post" in paths["/reset_prefix_cache"]


def test_without_dev_mode_there_is_no_route(server_loop, engine, monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with serve_built(server_loop, engine) as url:
        assert _server_info(url).status == 404
        assert "/server_info" not in fetch("GET", url + "/openapi.json").json()["paths"]
        reply = fetch("GET", url + "/v1/models")
        assert reply.json()["data"][0]["id"] == MODEL  # the server itself answers
