"""The engine's LoRA bookkeeping without a model: --max-loras in the scheduler, the LRU of
adapters read (--max-cpu-loras), and the adapters /metrics reports."""

from __future__ import annotations

import asyncio
import threading

from aioserve.engine.kv_cache_manager import KVCacheManager
from aioserve.engine.lora_requests import LoRAAdapterCache, LoRARequest
from aioserve.engine.request import Request, RequestStatus
from aioserve.engine.sampling_params import SamplingParams
from aioserve.engine.scheduler import Scheduler


def _request(request_id: str, lora: LoRARequest | None) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_tokens=4),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=4,
        lora=lora,
    )


A, B, C = (LoRARequest(name, i, f"/adapters/{name}") for i, name in enumerate("abc", 1))


def _scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    return Scheduler(
        kv,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=32,
        enable_chunked_prefill=True,
        max_loras=max_loras,
    )


def test_a_third_adapter_waits_while_later_requests_go_ahead():
    scheduler = _scheduler(max_loras=2)
    for request_id, lora in [("1", A), ("2", B), ("3", C), ("4", A), ("5", None), ("6", C)]:
        scheduler.add_request(_request(request_id, lora))
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks] == ["1", "2", "4", "5"]
    assert scheduler.lora_adapters() == (("a", "b"), ("c",))
    # Once a and b have ended, c's requests run, in their order.
    scheduler.finish_requests(["1", "2", "4"], RequestStatus.FINISHED_STOPPED)
    output = scheduler.schedule()
    assert [c.request.request_id for c in output.chunks if c.num_computed_tokens == 0] == ["3", "6"]
    assert scheduler.lora_adapters() == (("c",), ())


def test_without_lora_nothing_is_passed_over():
    scheduler = _scheduler(max_loras=0)
    for request_id in "123":
        scheduler.add_request(_request(request_id, None))
    assert len(scheduler.schedule().chunks) == 3


def test_adapters_read_are_kept_up_to_capacity_least_recently_used_first():
    reads = []

    def read(path: str) -> str:
        reads.append(path)
        return f"weights of {path}"

    cache = LoRAAdapterCache(read, capacity=2)
    assert cache.read_now(A) == "weights of /adapters/a"
    cache.read_now(B)
    cache.read_now(A)  # a is now the most recent
    cache.read_now(C)  # b goes
    assert cache.cached(A) and cache.cached(C) and cache.cached(B) is None
    cache.read_now(B)
    assert reads == ["/adapters/a", "/adapters/b", "/adapters/c", "/adapters/b"]
    # Another adapter under an old id (loaded in place) is read again.
    cache.read_now(LoRARequest("a", 1, "/adapters/elsewhere"))
    assert reads[-1] == "/adapters/elsewhere"


def test_concurrent_requests_for_one_adapter_share_one_read():
    started, release = threading.Event(), threading.Event()
    reads = []

    def read(path: str) -> str:
        reads.append(path)
        started.set()
        release.wait(10)
        return path

    async def main() -> list[str]:
        cache = LoRAAdapterCache(read, capacity=1)
        tasks = [asyncio.ensure_future(cache.read(A)) for _ in range(3)]
        await asyncio.to_thread(started.wait, 10)
        release.set()
        return await asyncio.gather(*tasks)

    assert asyncio.run(main()) == ["/adapters/a"] * 3
    assert reads == ["/adapters/a"]
