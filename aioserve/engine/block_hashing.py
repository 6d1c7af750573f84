"""Prefix-cache block keys: vLLM's --prefix-caching-hash-algo.

A full block is keyed by a digest of (its parent block's key, its token ids, its extra
keys), so that equal keys mean equal prefixes; the first block's parent is a root derived
from a seed. The algorithms are vLLM's:

- "sha256" (the default, as in vLLM 0.32): SHA-256 of the tuple pickled. Collision
  resistant, so its root may be public: PYTHONHASHSEED if set, else vLLM's fixed seed,
  and the keys are the same in every process.
- "sha256_cbor": SHA-256 of the tuple in canonical CBOR, reproducible from any language.
- "sha256_cbor_64bit" (earlier vLLM): the low 64 bits of the same digest, as an integer.
- "xxhash", "xxhash_cbor": xxHash-128 of the pickled or CBOR tuple; faster but not
  collision resistant, so their root is random per process unless PYTHONHASHSEED is set
  (with the optional `xxhash` package).
- "builtin" (earlier vLLM's default): Python's `hash`, 64 bits, random root likewise.

The extra keys are vLLM's too: a LoRA request's ("lora", name, path) in every block, its
cache salt's ("cache_salt", salt) in the first, which the chain carries into every later
key, and, for a prompt given as embeddings, ("prompt_embeds", SHA-256 of the block's rows)
in every block, and, for each image of the prompt that reaches into a block, ("image",
SHA-256 of its pixels, its offset) (vLLM keys such a block by the image's hash); so
requests with another adapter, salt, embeddings or image share no block.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import cbor2
import torch

if TYPE_CHECKING:
    from aioserve.engine.request import Request

BlockHash = bytes | int

DEFAULT_HASH_ALGORITHM = "sha256"
HASH_ALGORITHMS = (
    "sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "builtin", "sha256_cbor_64bit"
)  # fmt: skip
_PUBLIC_ROOT_SEED = "vllm-none-hash"  # vLLM's, for the collision-resistant algorithms
_SECRET_ROOT_ALGORITHMS = frozenset({"xxhash", "xxhash_cbor", "builtin"})


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _builtin_hash(value: Any) -> int:
    # Before Python 3.12 hash(None) is None's address, which differs between processes:
    # leave an absent extra key out, so that PYTHONHASHSEED alone fixes the keys.
    if isinstance(value, tuple) and value[-1] is None:
        value = value[:-1]
    return hash(value)


def _xxhash128() -> Callable[[bytes], bytes]:
    try:
        import xxhash
    except ImportError:
        raise ValueError(
            "--prefix-caching-hash-algo xxhash and xxhash_cbor need the xxhash package "
            "(pip install xxhash)"
        ) from None
    return xxhash.xxh3_128_digest


def _digest_function(algorithm: str) -> Callable[[Any], BlockHash]:
    if algorithm == "sha256":
        return lambda value: hashlib.sha256(_pickled(value)).digest()
    if algorithm == "sha256_cbor":
        return lambda value: hashlib.sha256(_cbor(value)).digest()
    if algorithm == "sha256_cbor_64bit":
        return lambda value: int.from_bytes(hashlib.sha256(_cbor(value)).digest()[-8:], "big")
    if algorithm == "xxhash":
        xxh = _xxhash128()
        return lambda value: xxh(_pickled(value))
    if algorithm == "xxhash_cbor":
        xxh = _xxhash128()
        return lambda value: xxh(_cbor(value))
    if algorithm == "builtin":
        return _builtin_hash
    raise ValueError(
        f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}"
    )


def check_hash_algorithm(algorithm: str) -> None:
    """Raise ValueError, naming the flag, when `algorithm` is unknown or cannot run here."""
    _digest_function(algorithm)


def _root_seed(algorithm: str) -> str:
    """PYTHONHASHSEED wins; otherwise a secret seed where collisions could be crafted."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algorithm in _SECRET_ROOT_ALGORITHMS:
        return os.urandom(32).hex()
    return _PUBLIC_ROOT_SEED


class BlockHasher:
    """Keys full blocks with one algorithm; `root` is every first block's parent."""

    def __init__(self, algorithm: str = DEFAULT_HASH_ALGORITHM) -> None:
        self.algorithm = algorithm
        self._digest = _digest_function(algorithm)
        self.root: BlockHash = self._digest(_root_seed(algorithm))

    def __call__(
        self,
        parent: BlockHash | None,
        token_ids: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        if parent is None:
            parent = self.root
        return self._digest((parent, tuple(token_ids), extra_keys))


def block_extra_keys(request: Request, start: int, end: int) -> tuple[Any, ...] | None:
    """The request's extra keys for its block of tokens start..end (None when it has none)."""
    keys: list[tuple[Any, ...]] = []
    if request.lora is not None:
        keys.append(("lora", request.lora.lora_name, request.lora.lora_path))
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    if request.prompt_embeds is not None:
        # The block's prompt rows stand for its tokens, which are placeholders.
        # Its rows' bytes as uint8: bfloat16 has no numpy type.
        rows = request.prompt_embeds[start:end].contiguous().view(torch.uint8).numpy()
        keys.append(("prompt_embeds", hashlib.sha256(rows).digest()))
    for image in request.images:
        # An image reaching into the block: its placeholders' tokens are alike for any image.
        if image.offset < end and start < image.offset + len(image.values):
            keys.append(("image", image.digest, image.offset))
    return tuple(keys) if keys else None
