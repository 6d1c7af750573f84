"""A GGUF file's tokenizer, converted by transformers once and then read from a cache.

transformers builds a fast tokenizer from a GGUF's metadata by parsing the file's
vocabulary and merges in Python (4.5 s for SmolLM2's 49,152 tokens on a 2-core CPU: a
tenth of the server's start). The converted tokenizer is saved with `save_pretrained` under
the cache folder (`resolve.cache_dir()/tokenizers/`), keyed by the file (path, size,
modification time) and the transformers and tokenizers versions that converted it, and
later starts load that folder (0.5 s). The folder is written under a temporary name and
renamed into place, so that two processes starting at once never read half of one. A cache
that cannot be written (a read-only home) only costs the conversion; one that cannot be
read is replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import tokenizers
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from aioserve.models.resolve import cache_dir

logger = logging.getLogger("aioserve")


def cached_tokenizer_folder(gguf_path: Path, download_dir: str | None = None) -> Path:
    """Where the converted tokenizer of `gguf_path` is kept."""
    stat = gguf_path.stat()
    identity = "|".join(
        (
            str(gguf_path.resolve()),
            str(stat.st_size),
            str(stat.st_mtime_ns),
            transformers.__version__,
            tokenizers.__version__,
        )
    )
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir(download_dir) / "tokenizers" / f"{gguf_path.stem}-{key}"


def load_gguf_tokenizer(
    gguf_path: Path, download_dir: str | None = None
) -> PreTrainedTokenizerBase:
    """The fast tokenizer of `gguf_path`, from the cache when it holds it."""
    folder = cached_tokenizer_folder(gguf_path, download_dir)
    if folder.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as error:  # noqa: BLE001 - whatever is wrong with it, convert again
            logger.warning(
                "the cached tokenizer at %s is unreadable (%s): converting", folder, error
            )
            shutil.rmtree(folder, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    _save(tokenizer, folder)
    return tokenizer


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        tokenizer.save_pretrained(str(staging))
        try:
            os.rename(staging, folder)
        except OSError:  # another process put it there first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        logger.info("cannot cache the converted tokenizer at %s: %s", folder, error)
