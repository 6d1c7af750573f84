"""Prompts, a transformers reference and an engine for end-to-end tests on the default model.

The reference is transformers itself, on the same GGUF file, float32, greedy decoding
written as a plain loop over its KV cache (so EOS does not end it early: our requests use
ignore_eos to get exactly 64 tokens as well).
"""

from __future__ import annotations

import functools

import torch

from aioserve import AsyncEngine
from aioserve.config.engine import engine_config_from_kwargs

NEW_TOKENS = 64

_TOPICS = [
    "The river that runs through the old town floods every spring, and the bakers move their ovens upstairs.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside chloroplasts.",
    "In 1869 the first transcontinental railroad in the United States was completed at Promontory Summit.",
    "A binary search halves the interval at each step, so it needs about log2(n) comparisons.",
    "The violinist tuned her instrument twice before the concert because the hall was unusually cold.",
    "Glaciers carve U-shaped valleys, while rivers tend to cut narrower V-shaped ones.",
    "Our team meets on Thursdays to review the backlog and decide what ships next month.",
    "Sourdough bread rises thanks to wild yeast and lactic acid bacteria living in the starter.",
    "The museum's new wing displays pottery from the Bronze Age alongside modern ceramics.",
    "Satellites in geostationary orbit circle the Earth once a day at about 35,786 kilometres.",
    "Good documentation explains why a decision was made, not only what the code does.",
    "Honeybees communicate the direction of flowers with a waggle dance inside the hive.",
]
LONG_PASSAGE = " ".join(_TOPICS * 3)  # over 500 tokens, and with 64 more under 1024

SHARED_PREFIX = (
    "Read the notes below and answer the question.\n\n" + " ".join(_TOPICS * 2) + "\n\nQuestion: "
)


def prompts(tokenizer) -> dict[str, list[int]]:
    """At least eight varied prompts as token ids: short, long, non-English, code, chat."""
    chat = [
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "List three uses of copper."},
        ],
    ]
    texts = {
        "short": "Hello",
        "long": LONG_PASSAGE + "\n\nSummary of the text above:",
        "french": "La tour Eiffel a été construite pour l'Exposition universelle de 1889 et",
        "chinese": "长城是中国古代的军事防御工程，",
        "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "numbers": "1, 2, 3, 5, 8, 13,",
    }
    ids = {name: tokenizer(text).input_ids for name, text in texts.items()}
    for i, messages in enumerate(chat):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids[f"chat{i}"] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def shared_prefix_prompts(tokenizer) -> list[list[int]]:
    questions = ["Which orbit takes one day?", "What makes sourdough rise?", "How do bees talk?"]
    return [tokenizer(SHARED_PREFIX + q + "\nAnswer:").input_ids for q in questions]


@functools.cache
def hf_model(gguf_path: str):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_greedy(gguf_path: str, prompt_ids: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy tokens after `prompt_ids`, computed once a test process (several
    modules ask for the same prompts)."""
    return list(_hf_greedy(gguf_path, tuple(prompt_ids), new_tokens))


@functools.cache
@torch.inference_mode()
def _hf_greedy(gguf_path: str, prompt_ids: tuple[int, ...], new_tokens: int) -> tuple[int, ...]:
    model = hf_model(gguf_path)
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past = out.past_key_values
    generated = []
    for _ in range(new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tuple(generated)


@torch.inference_mode()
def hf_prompt_logprobs(gguf_path: str, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax over a prompt: row i scores prompt token i + 1."""
    logits = hf_model(gguf_path)(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def float32_engine(model_path, max_model_len: int, **settings) -> AsyncEngine:
    """An AsyncEngine on the default model's GGUF: float32, seed 0, `max_model_len` context,
    run eagerly (tests/engine/test_smollm2_greedy.py covers the compiled step), KV blocks
    of 16 tokens (the tests' prompts are a few dozen tokens, and the prefix cache shares
    whole blocks only); `settings` are more LLM-style keywords."""
    settings.setdefault("block_size", 16)
    return AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=str(model_path),
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
            enforce_eager=True,
            **settings,
        )
    )


async def collect(engine: AsyncEngine, prompt, params, request_id: str) -> list:
    """Every RequestOutput of one request, in order."""
    return [out async for out in engine.generate(prompt, params, request_id)]
