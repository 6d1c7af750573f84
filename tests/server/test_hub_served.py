"""`aioserve serve org/tiny --revision v2 --hf-token TOKEN` for real, against the fake hub
(tests/models/fake_hub.py) pointed at by HF_ENDPOINT: the served weights are that
revision's (greedy tokens equal transformers' on its folder), every download carried the
token, and the token appears nowhere in the server's output ("non-default args" shows
hf_token as <hidden>)."""

from __future__ import annotations

from tests.models.fake_hub import FakeHub
from tests.models.tiny_revisions import (
    NEW_TOKENS,
    PROMPT,
    REPO,
    TOKEN,
    greedy_reference,
    tiny_revision,
)
from tests.server.openai_helpers import post
from tests.server.serve_process import serve_model


def test_serve_fetches_the_revision_with_the_token_and_never_logs_it(
    smollm2_tokenizer, tmp_path, monkeypatch
):
    revisions = {
        name: tiny_revision(smollm2_tokenizer, tmp_path / name, seed, f"[{name}]")
        for name, seed in (("main", 0), ("v2", 1))
    }
    hub = FakeHub()
    for name, folder in revisions.items():
        hub.add(REPO, name, folder, token=TOKEN)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    log = tmp_path / "serve.log"
    options = ["--revision", "v2", "--hf-token", TOKEN, "--download-dir", str(tmp_path / "hf")]
    options += ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager"]
    with hub.running():
        environment = hub.environment() | {"HF_TOKEN_PATH": str(tmp_path / "no-token")}
        with serve_model(REPO, "tiny", log, *options, env=environment) as url:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            reply = post(url, "/v1/completions", body)
    assert reply.status == 200, reply.body
    served = reply.json()["choices"][0]["token_ids"]
    assert served == greedy_reference(revisions["v2"]) != greedy_reference(revisions["main"])
    commit = hub.repos[REPO].refs["v2"]
    assert f"/{REPO}/resolve/{commit}/model.safetensors" in hub.files_fetched(REPO)
    assert {r.authorization for r in hub.requests if "/resolve/" in r.path} == {f"Bearer {TOKEN}"}
    output = log.read_text()
    assert "'hf_token': '<hidden>'" in output and "'revision': 'v2'" in output
    assert TOKEN not in output
