"""LoRA adapters through the whole engine, against PEFT on transformers.

A tiny random Llama (float32, the real SmolLM2 tokenizer) and random PEFT adapters: the
engine's greedy tokens and their logprobs must be PEFT's, for the base model and for each
adapter, whether they share a batch, take turns under --max-loras 1, or find the same
prompt's blocks in the prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from aioserve import LLM, LoRARequest, SamplingParams
from aioserve.models.lora_adapter import LoRAAdapterError
from tests.lora_adapters import make_lora_adapter, peft_reference

PROMPTS = [
    [504, 3575, 282, 4649, 314, 7, 9, 11],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    return {
        "every-layer": make_lora_adapter(tiny_model, folder / "a", rank=8, alpha=16, seed=1),
        "q-v-rslora": make_lora_adapter(
            tiny_model,
            folder / "b",
            rank=4,
            alpha=8,
            targets=("q_proj", "v_proj"),
            seed=2,
            use_rslora=True,
        ),
        "patterns": make_lora_adapter(
            tiny_model,
            folder / "c",
            rank=8,
            alpha=8,
            targets=("o_proj", "down_proj", "up_proj"),
            seed=3,
            rank_pattern={"down_proj": 2},
            alpha_pattern={"o_proj": 32},
        ),
    }


def peft_greedy(tiny_model: str, adapter: str | None, prompt: list[int]):
    """PEFT's greedy tokens and the log-softmax of each chosen one."""
    from transformers import AutoModelForCausalLM

    if adapter is None:
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    else:
        model = peft_reference(tiny_model, adapter)
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


@pytest.fixture(scope="module")
def references(tiny_model, adapters):
    names = [None, *adapters]
    return {
        (name, i): peft_greedy(tiny_model, adapters.get(name), prompt)
        for name in names
        for i, prompt in enumerate(PROMPTS)
    }


def _llm(tiny_model: str, **kwargs) -> LLM:
    return LLM(
        model=tiny_model,
        dtype="float32",
        enable_lora=True,
        max_lora_rank=8,
        block_size=8,
        max_model_len=256,
        **kwargs,
    )


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def _check(outputs, cases, references) -> None:
    for output, case in zip(outputs, cases, strict=True):
        want_tokens, want_logprobs = references[case]
        got = output.outputs[0]
        assert list(got.token_ids) == want_tokens, case
        got_logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert got_logprobs == pytest.approx(want_logprobs, abs=2e-4), case


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = _llm(tiny_model, max_loras=3)
    yield engine
    engine.close()


def test_base_and_adapters_in_one_batch_match_peft(llm, adapters, references):
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    cases = [(name, i) for name in [None, *adapters] for i in range(len(PROMPTS))]
    loras = [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n, _ in cases]
    prompts = [{"prompt_token_ids": PROMPTS[i]} for _, i in cases]
    outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    _check(outputs, cases, references)


def test_an_adapter_does_not_reuse_the_base_models_cached_prefix(llm, adapters, references):
    """The same prompt, first through the base model, then through an adapter: its blocks
    are in the prefix cache, but the adapter's keys and values are its own."""
    name = "every-layer"
    prompt = {"prompt_token_ids": PROMPTS[1]}
    base = llm.generate(prompt, GREEDY, use_tqdm=False)
    adapted = llm.generate(
        prompt, GREEDY, lora_request=LoRARequest(name, 1, adapters[name]), use_tqdm=False
    )
    _check(base + adapted, [(None, 1), (name, 1)], references)


def test_max_loras_one_runs_adapters_in_turn(tiny_model, adapters, references):
    engine = _llm(tiny_model, max_loras=1, max_cpu_loras=1)
    try:
        names = ["every-layer", "q-v-rslora", "every-layer", None, "patterns"]
        ids = {name: i + 1 for i, name in enumerate(adapters)}
        loras = [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in names]
        prompts = [{"prompt_token_ids": PROMPTS[0]}] * len(names)
        outputs = engine.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        _check(outputs, [(n, 0) for n in names], references)
        assert engine.engine.kv_cache.num_free_blocks == engine.engine.kv_cache.num_blocks
    finally:
        engine.close()


def test_an_adapter_above_max_lora_rank_is_refused(tiny_model, tmp_path, llm):
    big = make_lora_adapter(tiny_model, tmp_path / "big", rank=16, alpha=16)
    with pytest.raises(LoRAAdapterError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        llm.generate(
            {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=LoRARequest("big", 9, big)
        )


def test_lora_needs_enable_lora(tiny_model, adapters):
    engine = LLM(model=tiny_model, dtype="float32", enforce_eager=True, max_model_len=256)
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            engine.generate(
                {"prompt_token_ids": PROMPTS[0]},
                GREEDY,
                lora_request=LoRARequest("a", 1, adapters["every-layer"]),
            )
    finally:
        engine.close()
