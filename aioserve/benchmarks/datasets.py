"""Benchmark workloads: the prompts and output lengths `bench throughput` and `bench serve` send.

Each loader returns SampleRequests: a text prompt, its length in tokens as the engine will
count it (the tokenizer's special tokens included), and the number of tokens to generate.
The datasets are vLLM's, with their defaults:

- random: synthetic prompts of `input_len` tokens (spread by `range_ratio`), after an
  optional random prefix shared by every prompt;
- sharegpt: the first two turns of each conversation of a local ShareGPT JSON file;
- sonnet: lines drawn from a poem, wrapped in the chat template. The text shipped here
  (sonnets.txt) is eleven of Shakespeare's sonnets (1, 18, 29, 30, 55, 60, 71, 73, 106, 116,
  130), which are in the public domain; a file of your own can replace it;
- burstgpt: the request and response lengths of a local BurstGPT trace (CSV), GPT-4 rows;
- custom: the prompts (and optional output lengths) of a local JSONL file, one
  {"prompt": ..., "output_tokens": ...} object a line, rendered with the chat template
  unless told not to;
- prefix_repetition: `num_prefixes` random prefixes, each shared by an equal number of
  prompts with their own random suffix;
- hf: datasets from the Hugging Face hub, which aioserve's benchmarks do not download:
  refused with a message saying how to run the same workload from a local file.

Synthetic text is made from random token ids, decoded, then re-encoded and adjusted until
it has exactly the requested number of tokens (decoding and encoding again does not always
give the same number of tokens back).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from aioserve.config.declaration import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("aioserve")

DATASET_NAMES = ("sharegpt", "random", "sonnet", "burstgpt", "hf", "prefix_repetition", "custom")
SONNETS = Path(__file__).with_name("sonnets.txt")
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"

# vLLM's filter for ShareGPT conversations (is_valid_sequence).
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(ConfigError):
    """A workload that cannot be built: a missing or malformed file, impossible lengths."""


@dataclass(frozen=True)
class SampleRequest:
    # A list only for a pooling backend's batch of prompts (pooling.batch_requests).
    prompt: str | list[str]
    prompt_len: int  # tokens of `prompt` as the engine counts them, special tokens included
    expected_output_len: int
    model: str | None = None  # the model name it asks for, when not the run's (a LoRA adapter)


# --- synthetic text of an exact length --------------------------------------------------


def _allowed_token_ids(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Every id of the base vocabulary except the special tokens."""
    special = set(tokenizer.all_special_ids)
    return np.array([t for t in range(tokenizer.vocab_size) if t not in special])


def text_of_length(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: list[int],
    target_len: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
    max_retries: int = 10,
) -> tuple[str, int]:
    """Text decoded from `token_ids`, adjusted so it encodes to `target_len` tokens (no specials).

    Returns the text and its token count: `target_len`, unless the tokenizer kept changing
    the count for `max_retries` rounds, in which case the count is the text's true one.
    """
    ids = list(token_ids)
    for _ in range(max_retries + 1):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target_len:
            return text, target_len
        if len(ids) > target_len:
            ids = ids[:target_len]
        else:
            ids += allowed[rng.integers(0, len(allowed), target_len - len(ids))].tolist()
    logger.warning("a synthetic prompt has %d tokens instead of %d", len(ids), target_len)
    return text, len(ids)


# --- random -----------------------------------------------------------------------------


def random_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    input_len: int,
    output_len: int,
    *,
    prefix_len: int = 0,
    range_ratio: float = 0.0,
    seed: int = 0,
    output_range_ratio: float | None = None,
) -> list[SampleRequest]:
    """vLLM's random dataset: `prefix_len` shared random tokens, then `input_len` more.

    With `range_ratio` r, each request's input length is drawn uniformly from
    [len * (1 - r), len * (1 + r)], and its output length likewise with
    `output_range_ratio` (default: r). `input_len` counts the tokenizer's special tokens.
    """
    if output_range_ratio is None:
        output_range_ratio = range_ratio
    for which, ratio in (("input", range_ratio), ("output", output_range_ratio)):
        if not 0.0 <= ratio < 1.0:
            raise DatasetError(
                f"--random-range-ratio: the {which} ratio must be in [0, 1), got {ratio}"
            )
    if prefix_len < 0:
        raise DatasetError(f"the random prefix length must be at least 0, got {prefix_len}")
    if output_len < 1:
        raise DatasetError(f"the output length must be at least 1, got {output_len}")
    num_special = tokenizer.num_special_tokens_to_add()
    real_input_len = max(0, input_len - num_special)
    input_low = math.floor(real_input_len * (1 - range_ratio))
    input_high = math.ceil(real_input_len * (1 + range_ratio))
    if prefix_len + input_low < 1:
        raise DatasetError(
            f"the input length {input_len} leaves no room for a prompt: the tokenizer adds "
            f"{num_special} special tokens and the shortest prompt would be empty"
        )
    output_low = max(1, math.floor(output_len * (1 - output_range_ratio)))
    output_high = max(1, math.ceil(output_len * (1 + output_range_ratio)))

    rng = np.random.default_rng(seed)
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)
    allowed = _allowed_token_ids(tokenizer)
    prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
    requests = []
    for i in range(num_requests):
        body = allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
        text, length = text_of_length(
            tokenizer, prefix + body, prefix_len + int(input_lens[i]), rng, allowed
        )
        requests.append(SampleRequest(text, length + num_special, int(output_lens[i])))
    return requests


def parse_range_ratio(text: str) -> tuple[float, float]:
    """(input, output) ratios of --random-range-ratio: one number for both, or vLLM's JSON
    object {"input": r1, "output": r2}."""
    try:
        ratio = float(text)
        return ratio, ratio
    except ValueError:
        pass
    try:
        value = json.loads(text)
        return float(value["input"]), float(value["output"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise DatasetError(
            "--random-range-ratio takes a number or a JSON object with 'input' and 'output' "
            f'numbers, e.g. \'{{"input": 0.3, "output": 0.5}}\'; got {text!r}'
        ) from None


# --- sharegpt ---------------------------------------------------------------------------


def _read_sharegpt(path: str) -> list[list]:
    """The conversations of a ShareGPT file that have at least two turns (vLLM's filter,
    which comes before its shuffle)."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as error:
        raise DatasetError(f"--dataset-path: cannot read {path!r}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise DatasetError(f"--dataset-path: {path!r} is not valid JSON: {error}") from None
    if not isinstance(data, list):
        raise DatasetError(f"--dataset-path: {path!r} must hold a JSON list of conversations")
    conversations = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2:
            conversations.append(turns)
    return conversations


def _first_exchange(turns: list) -> tuple[str, str] | None:
    first, second = turns[0], turns[1]
    if isinstance(first, dict) and isinstance(second, dict):
        prompt, completion = first.get("value"), second.get("value")
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
    return None


def oversample(
    requests: list[SampleRequest], num_requests: int, seed: int, enabled: bool = True
) -> None:
    """Repeat randomly chosen requests until there are `num_requests`, as vLLM does (a
    generator seeded afresh with `seed`, one choice per missing request)."""
    if enabled and len(requests) < num_requests:
        logger.info("oversampling %d requests to reach %d", len(requests), num_requests)
        rng = random.Random(seed)
        extra = [rng.choice(requests) for _ in range(num_requests - len(requests))]
        requests.extend(extra)


def sharegpt_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    path: str,
    *,
    output_len: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    oversample_to_count: bool = True,
) -> list[SampleRequest]:
    """The first human turn of each conversation as the prompt; the reply's length as the
    output length unless `output_len` is given. Conversations are shuffled with `seed`
    (unless `shuffle` is off); too short or too long ones are skipped, as vLLM does; when
    too few are left, some are repeated (unless `oversample_to_count` is off)."""
    conversations = _read_sharegpt(path)
    if shuffle:
        random.Random(seed).shuffle(conversations)
    requests: list[SampleRequest] = []
    for turns in conversations:
        if len(requests) == num_requests:
            break
        pair = _first_exchange(turns)
        if pair is None:
            continue
        prompt, completion = pair
        prompt_len = len(tokenizer(prompt).input_ids)
        wanted = len(tokenizer(completion).input_ids) if output_len is None else output_len
        too_short = prompt_len < SHAREGPT_MIN_LEN or (
            output_len is None and wanted < SHAREGPT_MIN_LEN
        )
        too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or (
            prompt_len + wanted > SHAREGPT_MAX_TOTAL_LEN
        )
        if not (too_short or too_long):
            requests.append(SampleRequest(prompt, prompt_len, wanted))
    if not requests:
        raise DatasetError(
            f"--dataset-path: {path!r} has no conversation with a prompt of "
            f"{SHAREGPT_MIN_LEN} to {SHAREGPT_MAX_PROMPT_LEN} tokens and a reply that fits "
            f"in {SHAREGPT_MAX_TOTAL_LEN} tokens"
        )
    oversample(requests, num_requests, seed, oversample_to_count)
    return requests


# --- custom ---------------------------------------------------------------------------


def _read_jsonl(path: str) -> list[dict]:
    if not path.endswith(".jsonl"):
        raise DatasetError(f"--dataset-name custom reads JSONL files (*.jsonl), got {path!r}")
    rows = []
    try:
        with open(path, encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DatasetError(
                        f"--dataset-path: line {number} of {path!r} is not JSON: {error}"
                    ) from None
                if not isinstance(row, dict) or "prompt" not in row:
                    raise DatasetError(
                        f"--dataset-path: line {number} of {path!r} has no 'prompt' field"
                    )
                rows.append(row)
    except OSError as error:
        raise DatasetError(f"--dataset-path: cannot read {path!r}: {error.strerror}") from None
    return rows


def custom_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    path: str,
    *,
    output_len: int | None = 256,
    seed: int = 0,
    shuffle: bool = True,
    oversample_to_count: bool = True,
    chat_template: bool = True,
    chat_template_kwargs: dict | None = None,
) -> list[SampleRequest]:
    """vLLM's custom dataset: one {"prompt": ..., "output_tokens": ...} object a line.

    Rows are shuffled with `seed` unless `shuffle` is off. Each prompt is rendered as one
    user message with the chat template (and `chat_template_kwargs`) unless
    `chat_template` is off, and sent so rendered, whatever the endpoint, as vLLM does.
    The output length is `output_len`, or the row's output_tokens when it is None or -1.
    """
    rows = _read_jsonl(path)
    if shuffle:
        random.Random(seed).shuffle(rows)
    if chat_template and tokenizer.chat_template is None:
        raise DatasetError(
            "the custom dataset renders its prompts with the chat template, which this "
            "tokenizer lacks; pass --skip-chat-template"
        )
    requests: list[SampleRequest] = []
    for row in rows[:num_requests]:
        prompt = str(row["prompt"])
        if output_len is None or output_len == -1:
            if "output_tokens" not in row:
                raise DatasetError(
                    "without --custom-output-len (or with -1) every custom row needs "
                    "an 'output_tokens' field"
                )
            try:
                wanted = int(row["output_tokens"])
            except (TypeError, ValueError):
                raise DatasetError(
                    f"invalid 'output_tokens' in the custom dataset: {row['output_tokens']!r}; "
                    "it must be an integer"
                ) from None
        else:
            wanted = output_len
        if chat_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}],
                add_generation_prompt=True,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
        requests.append(SampleRequest(prompt, len(tokenizer(prompt).input_ids), wanted))
    if not requests:
        raise DatasetError(f"--dataset-path: {path!r} has no prompt")
    oversample(requests, num_requests, seed, oversample_to_count)
    return requests


# --- sonnet -----------------------------------------------------------------------------


def sonnet_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    *,
    input_len: int = 550,
    output_len: int = 150,
    prefix_len: int = 200,
    path: str | None = None,
    chat_formatted: bool = True,
    seed: int = 0,
) -> list[SampleRequest]:
    """vLLM's sonnet dataset: an instruction and poem lines, as one user chat message.

    The first lines of the poem, about `prefix_len` tokens' worth, start every prompt; the
    rest are drawn at random until the prompt has about `input_len` tokens. Whole lines are
    drawn, so a prompt has at most `input_len` tokens and at least `input_len` minus the
    longest line. With `chat_formatted`, the prompt is the rendered chat template (for a
    completions endpoint); otherwise the message text (for a chat endpoint).
    """
    source = Path(path) if path is not None else SONNETS
    try:
        lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    except OSError as error:
        raise DatasetError(
            f"--dataset-path: cannot read {str(source)!r}: {error.strerror}"
        ) from None
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise DatasetError(f"--dataset-path: {str(source)!r} has no text")
    if tokenizer.chat_template is None:
        raise DatasetError("the sonnet dataset needs a tokenizer with a chat template")

    def render(text: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )

    def count(text: str) -> int:
        return len(tokenizer(text).input_ids)

    average_line = sum(count(line) for line in lines) / len(lines)
    base_len = count(render(SONNET_INSTRUCTION))
    if input_len <= base_len:
        raise DatasetError(
            f"the sonnet input length must be more than the instruction's {base_len} tokens, "
            f"got {input_len}"
        )
    num_input_lines = round((input_len - base_len) / average_line)
    num_prefix_lines = min(max(round((prefix_len - base_len) / average_line), 0), num_input_lines)
    prefix = "".join(lines[:num_prefix_lines])
    rng = random.Random(seed)
    requests: list[SampleRequest] = []
    for _ in range(100 * num_requests):
        if len(requests) == num_requests:
            break
        drawn = rng.choices(lines, k=num_input_lines - num_prefix_lines)
        text = SONNET_INSTRUCTION + prefix + "".join(drawn)
        rendered = render(text)
        prompt_len = count(rendered)
        if prompt_len <= input_len:
            requests.append(
                SampleRequest(rendered if chat_formatted else text, prompt_len, output_len)
            )
    if len(requests) < num_requests:
        raise DatasetError(
            f"could not draw sonnet prompts of at most {input_len} tokens; raise the input length"
        )
    return requests


# --- burstgpt ---------------------------------------------------------------------------


def burstgpt_requests(
    tokenizer: PreTrainedTokenizerBase, num_requests: int, path: str, *, seed: int = 0
) -> list[SampleRequest]:
    """Synthetic prompts with the request and response token counts of a BurstGPT trace.

    Only GPT-4 rows with a positive response length are used, as in vLLM; rows are drawn
    with `seed`, with replacement when the trace has fewer rows than requests. The draw is
    the one vLLM's pandas `DataFrame.sample(n, random_state=seed)` makes: numpy's legacy
    RandomState(seed).choice over the row positions.
    """
    try:
        with open(path, encoding="utf-8", newline="") as file:
            rows = list(csv.DictReader(file))
    except OSError as error:
        raise DatasetError(f"--dataset-path: cannot read {path!r}: {error.strerror}") from None
    lengths = []
    for row in rows:
        try:
            if row["Model"] == "GPT-4" and int(row["Response tokens"]) > 0:
                lengths.append((int(row["Request tokens"]), int(row["Response tokens"])))
        except (KeyError, TypeError, ValueError):
            raise DatasetError(
                f"--dataset-path: {path!r} is not a BurstGPT CSV (columns Model, "
                "Request tokens and Response tokens, with whole numbers)"
            ) from None
    if not lengths:
        raise DatasetError(f"--dataset-path: {path!r} has no GPT-4 row with a response")
    positions = np.random.RandomState(seed).choice(
        len(lengths), size=num_requests, replace=num_requests > len(lengths)
    )
    chosen = [lengths[int(p)] for p in positions]
    num_special = tokenizer.num_special_tokens_to_add()
    allowed = _allowed_token_ids(tokenizer)
    token_rng = np.random.default_rng(seed)
    requests = []
    for i, (input_len, output_len) in enumerate(chosen):
        body_len = max(1, input_len - num_special)
        ids = [int(allowed[(i + j) % len(allowed)]) for j in range(body_len)]
        text, length = text_of_length(tokenizer, ids, body_len, token_rng, allowed)
        requests.append(SampleRequest(text, length + num_special, output_len))
    return requests


# --- prefix_repetition ------------------------------------------------------------------


def prefix_repetition_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    *,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes of `prefix_len` tokens, each followed by
    `num_requests // num_prefixes` random suffixes of `suffix_len` tokens; shuffled.

    Every prompt of a group starts with the same prefix text and has exactly
    prefix_len + suffix_len tokens (special tokens not counted, as in vLLM).
    """
    if num_prefixes < 1 or num_requests < num_prefixes:
        raise DatasetError(
            f"--num-prompts ({num_requests}) must be at least "
            f"--prefix-repetition-num-prefixes ({num_prefixes}), which must be at least 1"
        )
    if prefix_len < 0 or suffix_len < 1 or output_len < 1:
        raise DatasetError(
            "prefix repetition needs a prefix of at least 0 tokens and a suffix and an output "
            f"of at least 1, got {prefix_len}, {suffix_len} and {output_len}"
        )
    rng = np.random.default_rng(seed)
    allowed = _allowed_token_ids(tokenizer)
    num_special = tokenizer.num_special_tokens_to_add()
    total = prefix_len + suffix_len

    def random_ids(count: int) -> list[int]:
        return allowed[rng.integers(0, len(allowed), size=count)].tolist()

    requests = []
    for _ in range(num_prefixes):
        prefix_text, _ = text_of_length(tokenizer, random_ids(prefix_len), prefix_len, rng, allowed)
        prefix_ids = tokenizer.encode(prefix_text, add_special_tokens=False)
        for _ in range(num_requests // num_prefixes):
            # text_of_length only cuts or extends the end, so the prefix's text stays whole
            # even when the tokenizer merges across the boundary.
            text, length = text_of_length(
                tokenizer, prefix_ids + random_ids(suffix_len), total, rng, allowed
            )
            requests.append(SampleRequest(text, length + num_special, output_len))
    random.Random(seed).shuffle(requests)
    return requests


# --- hf ---------------------------------------------------------------------------------


def refuse_hf_dataset() -> NoReturn:
    """The `hf` dataset needs the Hugging Face hub; say how to run from a local file instead."""
    raise DatasetError(
        "--dataset-name hf downloads its data from the Hugging Face hub, which aioserve's "
        "benchmarks do not do: save the conversations as ShareGPT JSON and use "
        "--dataset-name sharegpt --dataset-path FILE (or a BurstGPT CSV with "
        "--dataset-name burstgpt)"
    )
