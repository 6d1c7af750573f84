"""--prefix-caching-hash-algo: each algorithm keys a block as vLLM does (its formula, written
out here with hashlib, and canonical CBOR encoded by hand), the collision-resistant ones
the same in every process and the others from a secret root unless PYTHONHASHSEED is set;
LoRA and cache-salt keys keep other requests' blocks apart; an engine built with each
algorithm hits its cache and says which algorithm in vllm:cache_config_info.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys

import pytest

from aioserve import LLM, SamplingParams
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.block_hashing import (
    HASH_ALGORITHMS,
    BlockHasher,
    block_extra_keys,
    check_hash_algorithm,
)
from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.lora_requests import LoRARequest
from aioserve.engine.request import Request
from aioserve.server.metrics import cache_config_labels

TOKENS = [1, 2, 3, 4]


def _sha256_pickled(value) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _key_in_child(algorithm: str, env: dict[str, str]) -> str:
    """The key of TOKENS' first block in a new interpreter."""
    script = (
        "from aioserve.engine.block_hashing import BlockHasher; "
        f"print(repr(BlockHasher({algorithm!r})(None, {TOKENS!r})))"
    )
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"} | env
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=child_env,
    ).stdout


def test_sha256_keys_are_vllms_and_the_same_in_every_process(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    root = _sha256_pickled("vllm-none-hash")
    first = _sha256_pickled((root, tuple(TOKENS), None))
    second = _sha256_pickled((first, (5, 6, 7, 8), (("cache_salt", "s"),)))
    hasher = BlockHasher("sha256")
    assert hasher(None, TOKENS) == first
    assert hasher(first, [5, 6, 7, 8], (("cache_salt", "s"),)) == second
    assert _key_in_child("sha256", {}) == _key_in_child("sha256", {}) == repr(first) + "\n"


def test_pythonhashseed_sets_the_root_of_a_collision_resistant_algorithm(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    root = _sha256_pickled("123")
    assert BlockHasher("sha256")(None, TOKENS) == _sha256_pickled((root, tuple(TOKENS), None))


def _cbor_by_hand(root: bytes, tokens: list[int]) -> bytes:
    """Canonical CBOR of (root, tuple(tokens), None), for 32-byte roots and tokens < 24:
    an array of three, a byte string, an array of small integers, null."""
    return (
        bytes([0x83, 0x58, len(root)]) + root + bytes([0x80 + len(tokens), *tokens]) + bytes([0xF6])
    )


def test_sha256_cbor_hashes_canonical_cbor_and_its_64_bit_form_keeps_the_low_bits(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    root = hashlib.sha256(bytes([0x6E]) + b"vllm-none-hash").digest()  # text of 14 bytes
    digest = hashlib.sha256(_cbor_by_hand(root, TOKENS)).digest()
    assert BlockHasher("sha256_cbor")(None, TOKENS) == digest
    low = BlockHasher("sha256_cbor_64bit")
    root_64 = int.from_bytes(root[-8:], "big")
    assert low.root == root_64
    assert low(None, TOKENS) < 2**64


@pytest.mark.parametrize("algorithm", ["builtin", "xxhash", "xxhash_cbor"])
def test_algorithms_that_are_not_collision_resistant_take_a_secret_root(algorithm):
    # With a public root a prompt could be crafted offline to collide with another
    # user's cached prefix; PYTHONHASHSEED shares the root between instances on purpose.
    assert _key_in_child(algorithm, {}) != _key_in_child(algorithm, {})
    seeded = {"PYTHONHASHSEED": "7"}
    assert _key_in_child(algorithm, seeded) == _key_in_child(algorithm, seeded)


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_each_algorithm_chains_its_keys(algorithm):
    hasher = BlockHasher(algorithm)
    first = hasher(None, TOKENS)
    assert hasher(None, list(TOKENS)) == first
    assert hasher(None, [1, 2, 3, 5]) != first
    assert hasher(first, TOKENS) != first
    assert hasher(hasher(None, [9, 9, 9, 9]), TOKENS) != hasher(first, TOKENS)


def _request(request_id: str, **fields) -> Request:
    """A request of three 4-token blocks, with `fields` (lora, cache_salt, ...)."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, 13)),
        sampling_params=SamplingParams(max_tokens=4),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=4,
        **fields,
    )


def _cached_request(kv: KVCacheManager, request_id: str, **fields) -> Request:
    request = _request(request_id, **fields)
    assert kv.allocate(request, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request, request.num_tokens)
    kv.free(request)
    return request


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_requests_share_blocks_only_with_the_same_adapter_and_salt(algorithm, tmp_path):
    kv = KVCacheManager(32, 4, enable_prefix_caching=True, hash_algorithm=algorithm)
    adapter = LoRARequest("a", 1, str(tmp_path / "a"))
    moved = LoRARequest("a", 1, str(tmp_path / "elsewhere"))
    cached = {
        "plain": _cached_request(kv, "plain"),
        "lora": _cached_request(kv, "lora", lora=adapter),
        "salted": _cached_request(kv, "salted", cache_salt="tenant"),
    }

    def hits(**fields) -> int:
        return len(kv.find_cached_prefix(_request("probe", **fields)))

    assert hits() == hits(lora=adapter) == hits(cache_salt="tenant") == 2
    assert hits(lora=moved) == 0, "an adapter name pointed at other weights shares nothing"
    assert hits(cache_salt="other") == 0
    # The adapter is in every block's key, the salt in the first (and so in the chain).
    for i in range(3):
        assert len({r.block_hashes[i] for r in cached.values()}) == 3


def test_the_adapter_is_in_every_blocks_extra_keys_and_the_salt_in_the_first(tmp_path):
    adapter = LoRARequest("a", 1, str(tmp_path / "a"))
    request = _request("r", lora=adapter, cache_salt="tenant")
    lora_key = ("lora", "a", str(tmp_path / "a"))
    assert block_extra_keys(request, 0, 4) == (lora_key, ("cache_salt", "tenant"))
    assert block_extra_keys(request, 4, 8) == (lora_key,)
    request.lora = None
    assert block_extra_keys(request, 4, 8) is None


def test_xxhash_without_its_package_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)
    with pytest.raises(ValueError) as error:
        check_hash_algorithm("xxhash_cbor")
    assert str(error.value) == (
        "--prefix-caching-hash-algo xxhash and xxhash_cbor need the xxhash package "
        "(pip install xxhash)"
    )
    check_hash_algorithm("sha256")


def test_the_flag_takes_vllms_choices_and_defaults_to_sha256():
    assert engine_config_from_kwargs().cache.prefix_caching_hash_algo == "sha256"
    for algorithm in HASH_ALGORITHMS:
        config = engine_config_from_kwargs(prefix_caching_hash_algo=algorithm)
        assert config.cache.prefix_caching_hash_algo == algorithm
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo must be one of sha256, "):
        engine_config_from_kwargs(prefix_caching_hash_algo="md5")


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "builtin"])
def test_an_engine_hits_its_cache_with_each_algorithm(tiny_model, algorithm):
    engine = LLM(
        model=tiny_model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        block_size=16,
        prefix_caching_hash_algo=algorithm,
    )
    try:
        prompt = {"prompt_token_ids": list(range(100, 150))}
        params = SamplingParams(max_tokens=4, temperature=0.0)
        (first,) = engine.generate(prompt, params)
        (again,) = engine.generate(prompt, params)
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == 48
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert engine.engine.kv_cache.hash_block.algorithm == algorithm
        labels = cache_config_labels(engine.engine.settings)
        assert labels["prefix_caching_hash_algo"] == algorithm
    finally:
        engine.close()
