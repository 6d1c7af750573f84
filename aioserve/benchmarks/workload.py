"""From a bench command's arguments to its requests: which dataset, with which lengths.

`bench throughput` and `bench serve` name their dataset options differently, as in vLLM:
throughput has `--input-len`, `--output-len`, `--prefix-len` and vLLM's newer
`--random-input-len`, `--random-output-len`, `--random-prefix-len`; for the random
dataset a `--random-*` option wins over its plain one, which wins over the default
(1024, 128, 0). Serve has one group per dataset (`--random-input-len`,
`--sonnet-prefix-len`, ...), which its general `--input-len` / `--output-len` override.
With `--lora-modules`, serve's requests ask for LoRA adapters by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from aioserve.benchmarks import datasets
from aioserve.benchmarks.datasets import DatasetError, SampleRequest
from aioserve.config.declaration import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

# Defaults of vLLM's prefix repetition dataset: prefix, suffix, prefixes, output tokens.
PREFIX_REPETITION_DEFAULTS = (256, 256, 10, 128)
# Defaults of the random dataset's lengths: input, output, prefix tokens.
RANDOM_DEFAULTS = (1024, 128, 0)

# vLLM's tokenizer modes that load the transformers tokenizer, and the loader's mode for
# each. cohere, kimi_k3 and inkling only swap vLLM's chat renderer, which the benchmark
# does not use for token counts.
HF_TOKENIZER_MODES = {
    "auto": "auto",
    "hf": "auto",
    "slow": "slow",
    "cohere": "auto",
    "kimi_k3": "auto",
    "inkling": "auto",
}


def load_tokenizer(model: str, tokenizer_mode: str = "auto") -> PreTrainedTokenizerBase:
    """The tokenizer of `model` (a local path, a packaged model or a hub id), as the engine
    loads it. `tokenizer_mode` is vLLM's: the modes of HF_TOKENIZER_MODES load the
    transformers tokenizer; the others (mistral, deepseek_v32, ...) need tokenizers of
    vLLM's own, which aioserve does not have, and are refused."""
    from aioserve.models.checkpoint import open_checkpoint

    mode = HF_TOKENIZER_MODES.get(tokenizer_mode)
    if mode is None:
        raise ConfigError(
            f"--tokenizer-mode {tokenizer_mode}: aioserve has no {tokenizer_mode!r} "
            "tokenizer (only the transformers one); use "
            f"{', '.join(HF_TOKENIZER_MODES)}"
        )
    try:
        return open_checkpoint(model).load_tokenizer(tokenizer_mode=mode)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot load the tokenizer of {model!r}: {error}") from None


def _needs_path(args: argparse.Namespace) -> str:
    if args.dataset_path is None:
        raise DatasetError(f"--dataset-name {args.dataset_name} needs --dataset-path")
    return args.dataset_path


def _prefix_repetition(
    args: argparse.Namespace,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    output_len: int | None,
) -> list[SampleRequest]:
    prefix_len, suffix_len, num_prefixes, default_output = PREFIX_REPETITION_DEFAULTS

    def given(value: int | None, default: int) -> int:
        return default if value is None else value

    return datasets.prefix_repetition_requests(
        tokenizer,
        args.num_prompts,
        prefix_len=given(args.prefix_repetition_prefix_len, prefix_len),
        suffix_len=given(args.prefix_repetition_suffix_len, suffix_len),
        num_prefixes=given(args.prefix_repetition_num_prefixes, num_prefixes),
        output_len=given(args.prefix_repetition_output_len, given(output_len, default_output)),
        seed=seed,
    )


def settle_throughput_dataset(args: argparse.Namespace) -> None:
    """Apply vLLM's dataset rules of `bench throughput` to `args`, before anything loads.

    --dataset is the deprecated spelling of --dataset-path. Without a dataset path, sharegpt
    and burstgpt fall back to random. The hf dataset is refused.
    """
    if args.dataset is not None:
        print("--dataset is deprecated: use --dataset-name and --dataset-path")
        args.dataset_path = args.dataset
    if args.dataset_name == "hf":
        datasets.refuse_hf_dataset()
    if args.dataset_path is None and args.dataset_name in ("sharegpt", "burstgpt"):
        print("When dataset path is not set, it will default to random dataset")
        args.dataset_name = "random"


def random_lengths(args: argparse.Namespace) -> tuple[int, int, int]:
    """`bench throughput`'s random (input, output, prefix) lengths: each --random-* option,
    else its plain one (--input-len, --output-len, --prefix-len), else RANDOM_DEFAULTS."""
    lengths = []
    for name, default in zip(
        ("input_len", "output_len", "prefix_len"), RANDOM_DEFAULTS, strict=True
    ):
        for value in (getattr(args, "random_" + name), getattr(args, name), default):
            if value is not None:
                lengths.append(value)
                break
    return lengths[0], lengths[1], lengths[2]


def throughput_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, seed: int, chat: bool
) -> list[SampleRequest]:
    """The requests of `bench throughput`, from options settled by settle_throughput_dataset.

    --output-len overrides the dataset's output lengths.
    """
    name = args.dataset_name
    if name == "random":
        input_len, output_len, prefix_len = random_lengths(args)
        input_ratio, output_ratio = datasets.parse_range_ratio(args.random_range_ratio)
        return datasets.random_requests(
            tokenizer,
            args.num_prompts,
            input_len,
            output_len,
            prefix_len=prefix_len,
            range_ratio=input_ratio,
            output_range_ratio=output_ratio,
            seed=seed,
        )
    if name == "sharegpt":
        return datasets.sharegpt_requests(
            tokenizer,
            args.num_prompts,
            args.dataset_path,
            output_len=args.output_len,
            seed=seed,
            oversample_to_count=not args.no_oversample,
        )
    if name == "sonnet":
        return datasets.sonnet_requests(
            tokenizer,
            args.num_prompts,
            input_len=550 if args.input_len is None else args.input_len,
            output_len=150 if args.output_len is None else args.output_len,
            prefix_len=0 if args.prefix_len is None else args.prefix_len,
            path=args.dataset_path,
            chat_formatted=not chat,
            seed=seed,
        )
    if name == "burstgpt":
        requests = datasets.burstgpt_requests(
            tokenizer, args.num_prompts, args.dataset_path, seed=seed
        )
        if args.output_len is not None:
            requests = [SampleRequest(r.prompt, r.prompt_len, args.output_len) for r in requests]
        return requests
    if name == "prefix_repetition":
        return _prefix_repetition(args, tokenizer, seed, args.output_len)
    datasets.refuse_hf_dataset()  # the one name left


def serve_requests(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase, chat: bool
) -> list[SampleRequest]:
    """The requests of `bench serve`, from its per-dataset options (vLLM's rules)."""
    name, seed = args.dataset_name, args.seed
    if name == "hf":
        datasets.refuse_hf_dataset()
    if name in ("random", "prefix_repetition") and args.dataset_path is not None:
        raise DatasetError(f"--dataset-name {name} generates its prompts: drop --dataset-path")
    if name == "random":
        input_ratio, output_ratio = datasets.parse_range_ratio(args.random_range_ratio)
        return datasets.random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len if args.input_len is None else args.input_len,
            args.random_output_len if args.output_len is None else args.output_len,
            prefix_len=args.random_prefix_len,
            range_ratio=input_ratio,
            output_range_ratio=output_ratio,
            seed=seed,
        )
    if name == "sharegpt":
        output_len = args.sharegpt_output_len if args.output_len is None else args.output_len
        return datasets.sharegpt_requests(
            tokenizer,
            args.num_prompts,
            _needs_path(args),
            output_len=output_len,
            seed=seed,
            shuffle=not args.disable_shuffle,
            oversample_to_count=not args.no_oversample,
        )
    if name == "custom":
        return datasets.custom_requests(
            tokenizer,
            args.num_prompts,
            _needs_path(args),
            output_len=args.custom_output_len if args.output_len is None else args.output_len,
            seed=seed,
            shuffle=not args.disable_shuffle,
            oversample_to_count=not args.no_oversample,
            chat_template=not args.skip_chat_template,
            chat_template_kwargs=args.chat_template_kwargs,
        )
    if name == "sonnet":
        return datasets.sonnet_requests(
            tokenizer,
            args.num_prompts,
            input_len=args.sonnet_input_len if args.input_len is None else args.input_len,
            output_len=args.sonnet_output_len if args.output_len is None else args.output_len,
            prefix_len=args.sonnet_prefix_len,
            path=args.dataset_path,
            chat_formatted=not chat,
            seed=seed,
        )
    if name == "burstgpt":
        return datasets.burstgpt_requests(tokenizer, args.num_prompts, _needs_path(args), seed=seed)
    return _prefix_repetition(args, tokenizer, seed, args.output_len)


def assigned(choices: Sequence[T], count: int, assignment: str, seed: int) -> list[T]:
    """One of `choices` for each of `count` requests, as vLLM's benchmarks assign LoRA
    adapters: in turn (round-robin) or drawn at random (seeded)."""
    if assignment == "round-robin":
        return [choices[i % len(choices)] for i in range(count)]
    rng = random.Random(seed)
    return [rng.choice(choices) for _ in range(count)]


def with_lora_modules(
    requests: list[SampleRequest], names: Sequence[str], assignment: str, seed: int
) -> list[SampleRequest]:
    """The requests, each asking for one of the LoRA adapters `names` instead of the model,
    as vLLM's `bench serve --lora-modules` sends them: in turn (round-robin) or drawn at
    random (seeded)."""
    models = assigned(names, len(requests), assignment, seed)
    return [dataclasses.replace(r, model=m) for r, m in zip(requests, models, strict=True)]
