"""`aioserve bench throughput`: offline generation throughput, as `vllm bench throughput`.

Every request of the workload is handed to the engine at once and the run is timed from
the first request to the last output. Requests sample at temperature 1 with EOS ignored,
so each generates exactly its output length. Backends:

- aioserve (default; `vllm` is accepted for vLLM command lines): the offline `LLM`, or the
  `AsyncEngine` with --async-engine;
- aioserve-chat (`vllm-chat`): `LLM.chat`, each prompt one user message;
- hf: transformers' batched `generate` on the same model files (aioserve.benchmarks.hf_backend);
- mii: refused (DeepSpeed-MII is not part of aioserve's stack).

With --num-warmups, that many requests of the same dataset (drawn with seed + 1, as vLLM
does) run untimed first. It prints vLLM's line "Throughput: X requests/s, Y total
tokens/s, Z output tokens/s" and writes --output-json with vLLM's keys. Token counts come from what the engine returned
(prompt tokens once per request, output tokens of every sample).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from aioserve.benchmarks.datasets import SampleRequest
from aioserve.benchmarks.workload import assigned, settle_throughput_dataset, throughput_requests
from aioserve.config.declaration import ConfigError
from aioserve.config.engine import EngineConfig, engine_config_from_args
from aioserve.engine.outputs import RequestOutput
from aioserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from aioserve.engine.async_engine import AsyncEngine
    from aioserve.engine.lora_requests import LoRARequest

OUR_BACKENDS = ("aioserve", "vllm")
CHAT_BACKENDS = ("aioserve-chat", "vllm-chat")
BACKENDS = (*OUR_BACKENDS, *CHAT_BACKENDS, "hf", "mii")


def sampling_params(request: SampleRequest, n: int, detokenize: bool) -> SamplingParams:
    """vLLM's benchmark sampling: temperature 1, top-p 1, exactly the expected output length."""
    return SamplingParams(
        n=n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=request.expected_output_len,
        detokenize=detokenize,
    )


def lora_requests(
    args: argparse.Namespace, count: int, max_loras: int, seed: int
) -> list[LoRARequest | None]:
    """Each request's adapter, as vLLM's benchmark assigns them: --lora-path under one of
    `max_loras` ids named after themselves, drawn at random or in turn (--lora-assignment);
    None for every request without --lora-path."""
    from aioserve.engine.lora_requests import LoRARequest

    if args.lora_path is None:
        return [None] * count
    ids = assigned(range(1, max_loras + 1), count, args.lora_assignment, seed)
    return [LoRARequest(str(i), i, args.lora_path) for i in ids]


def count_tokens(outputs: Sequence[RequestOutput]) -> tuple[int, int]:
    """(prompt tokens, output tokens) of finished requests: each prompt once, every sample."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return prompt_tokens, output_tokens


def _check_fits(requests: Sequence[SampleRequest], max_model_len: int) -> None:
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if longest > max_model_len:
        raise ConfigError(
            f"a request needs {longest} tokens (prompt and output) but the model's context is "
            f"{max_model_len}; raise --max-model-len or shorten the requests"
        )


def warmup_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, seed: int, chat: bool
) -> list[SampleRequest]:
    """The --num-warmups untimed requests: the same dataset, drawn with seed + 1."""
    if args.num_warmups <= 0:
        return []
    warmup_args = argparse.Namespace(**{**vars(args), "num_prompts": args.num_warmups})
    requests = throughput_requests(warmup_args, tokenizer, seed + 1, chat)
    print(f"Warming up with {len(requests)} requests...")
    return requests


def run_aioserve(
    config: EngineConfig,
    args: argparse.Namespace,
    chat: bool,
) -> tuple[list[SampleRequest], float, list[RequestOutput]]:
    """The workload on the offline LLM: (requests, seconds, outputs)."""
    from aioserve.engine.llm import LLM

    def run(batch: Sequence[SampleRequest], seed: int) -> tuple[float, list[RequestOutput]]:
        params = [sampling_params(r, args.n, not args.disable_detokenize) for r in batch]
        loras = lora_requests(args, len(batch), config.lora.max_loras, seed)
        if chat:
            conversations = [[{"role": "user", "content": r.prompt}] for r in batch]
            start = time.perf_counter()
            outputs = llm.chat(conversations, params, use_tqdm=True, lora_request=loras)
        else:
            _check_fits(batch, llm.engine.settings.max_model_len)
            start = time.perf_counter()
            outputs = llm.generate(
                [r.prompt for r in batch], params, use_tqdm=True, lora_request=loras
            )
        return time.perf_counter() - start, outputs

    with LLM.from_config(config) as llm:
        tokenizer, seed = llm.get_tokenizer(), config.model.seed
        requests = throughput_requests(args, tokenizer, seed, chat)
        if warmups := warmup_requests(args, tokenizer, seed, chat):
            run(warmups, seed + 1)
        elapsed, outputs = run(requests, seed)
    return requests, elapsed, outputs


async def _generate_all(
    engine: AsyncEngine, config: EngineConfig, args: argparse.Namespace
) -> tuple[list[SampleRequest], float, list[RequestOutput]]:
    """Every request as its own generate stream: (requests, seconds, final outputs).

    The engine is shut down at the end, whatever happens.
    """

    async def one(
        index: int | str, request: SampleRequest, lora: LoRARequest | None, bar: tqdm | None
    ) -> RequestOutput:
        params = sampling_params(request, args.n, not args.disable_detokenize)
        stream = engine.generate(request.prompt, params, f"bench-{index}", lora_request=lora)
        async for output in stream:
            last = output
        if bar is not None:
            bar.update(1)
        return last

    try:
        seed = config.model.seed
        requests = throughput_requests(args, engine.tokenizer, seed, chat=False)
        warmups = warmup_requests(args, engine.tokenizer, seed, chat=False)
        _check_fits([*requests, *warmups], engine.settings.max_model_len)
        max_loras = config.lora.max_loras
        warmup_loras = lora_requests(args, len(warmups), max_loras, seed + 1)
        await asyncio.gather(
            *(
                one(f"warmup-{i}", r, lr, None)
                for i, (r, lr) in enumerate(zip(warmups, warmup_loras, strict=True))
            )
        )
        loras = lora_requests(args, len(requests), max_loras, seed)
        with tqdm(total=len(requests), desc="Processed prompts") as bar:
            start = time.perf_counter()
            outputs = await asyncio.gather(
                *(one(i, r, lr, bar) for i, (r, lr) in enumerate(zip(requests, loras, strict=True)))
            )
            elapsed = time.perf_counter() - start
    finally:
        await engine.shutdown()
    return requests, elapsed, list(outputs)


def run_aioserve_async(
    config: EngineConfig, args: argparse.Namespace
) -> tuple[list[SampleRequest], float, list[RequestOutput]]:
    """The workload on the AsyncEngine (on uvloop when installed)."""
    from aioserve.engine.async_engine import AsyncEngine

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    return run(_generate_all(AsyncEngine.from_config(config), config, args))


def run_hf(config: EngineConfig, args: argparse.Namespace) -> tuple[list[SampleRequest], float]:
    """The workload on transformers' `generate`: (requests, seconds)."""
    from aioserve.benchmarks.hf_backend import load_transformers_model, run_transformers
    from aioserve.engine.resolution import hub_options
    from aioserve.models.checkpoint import open_checkpoint

    model_cfg = config.model
    checkpoint = open_checkpoint(
        model_cfg.model,
        load_format=config.load.load_format,
        hf_overrides=model_cfg.hf_overrides,
        download_dir=config.load.download_dir,
        hf_config_path=model_cfg.hf_config_path,
        rope_scaling=model_cfg.rope_scaling,
        rope_theta=model_cfg.rope_theta,
        hub=hub_options(model_cfg),
    )
    tokenizer = checkpoint.load_tokenizer(model_cfg.tokenizer, model_cfg.tokenizer_mode)
    requests = throughput_requests(args, tokenizer, model_cfg.seed, chat=False)
    warmups = warmup_requests(args, tokenizer, model_cfg.seed, chat=False)
    model = load_transformers_model(checkpoint, model_cfg.dtype)

    def run(batch: list[SampleRequest]) -> float:
        return run_transformers(
            model,
            tokenizer,
            batch,
            n=args.n,
            max_batch_size=args.hf_max_batch_size,
            disable_detokenize=args.disable_detokenize,
        )

    if warmups:
        run(warmups)
    return requests, run(requests)


def _check_options(args: argparse.Namespace, config: EngineConfig) -> None:
    if args.backend == "mii":
        raise ConfigError(
            "--backend mii (DeepSpeed-MII) is not available in aioserve; "
            "use aioserve (alias vllm), aioserve-chat (alias vllm-chat) or hf"
        )
    settle_throughput_dataset(args)
    if args.num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.num_warmups < 0:
        raise ConfigError(f"--num-warmups must be at least 0, got {args.num_warmups}")
    if config.lora.enable_lora and args.backend not in (*OUR_BACKENDS, *CHAT_BACKENDS):
        raise ConfigError("LoRA benchmarking is only supported for the aioserve (vllm) backend")
    if config.lora.enable_lora and args.lora_path is None:
        raise ConfigError("LoRA path must be provided when enable_lora is True")
    if args.lora_path is not None and not config.lora.enable_lora:
        raise ConfigError("--lora-path needs --enable-lora")
    if args.n < 1:
        raise ConfigError(f"--n must be at least 1, got {args.n}")
    if args.backend == "hf":
        if args.hf_max_batch_size is None:
            raise ConfigError("--backend hf needs --hf-max-batch-size")
        if args.hf_max_batch_size < 1:
            raise ConfigError(
                f"--hf-max-batch-size must be at least 1, got {args.hf_max_batch_size}"
            )
        if config.load.load_format == "dummy":
            raise ConfigError("--backend hf needs real weights, not --load-format dummy")
        load = config.load
        if load.ignore_patterns != ["original/**/*"] or load.pt_load_map_location != "cpu":
            raise ConfigError(
                "--backend hf loads the model with transformers' from_pretrained, which takes "
                "no --ignore-patterns or --pt-load-map-location"
            )
    elif args.hf_max_batch_size is not None:
        raise ConfigError("--hf-max-batch-size is only for --backend hf")
    if args.async_engine and args.backend not in OUR_BACKENDS:
        raise ConfigError("--async-engine is only for --backend aioserve (alias vllm)")


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run `bench throughput` with parsed arguments; print the figures and return them."""
    config = engine_config_from_args(args)
    _check_options(args, config)
    if args.backend == "hf":
        requests, elapsed = run_hf(config, args)
        prompt_tokens = sum(r.prompt_len for r in requests)
        output_tokens = args.n * sum(r.expected_output_len for r in requests)
    else:
        if args.async_engine:
            requests, elapsed, outputs = run_aioserve_async(config, args)
        else:
            requests, elapsed, outputs = run_aioserve(config, args, args.backend in CHAT_BACKENDS)
        prompt_tokens, output_tokens = count_tokens(outputs)
    total_tokens = prompt_tokens + output_tokens
    print(
        f"Throughput: {len(requests) / elapsed:.2f} requests/s, "
        f"{total_tokens / elapsed:.2f} total tokens/s, "
        f"{output_tokens / elapsed:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    results = {
        "model_id": config.model.model,
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": total_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": total_tokens / elapsed,
    }
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=4)
    return results
