"""Prompts given as embeddings (--enable-prompt-embeds) against transformers' own
`inputs_embeds` on the same weights: a prompt of arbitrary rows (not any token's
embedding), greedy, eager and compiled, in chunks and beside token prompts; the prefix
cache keys their blocks by their rows; what such a prompt may not ask for is refused.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from aioserve import LLM, SamplingParams
from aioserve.engine.admission import InvalidRequest
from aioserve.engine.plan_builder import new_sequence
from aioserve.engine.request import Request

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
TOKEN_PROMPT = [504, 1030, 42, 7, 9000, 311, 12, 12, 77, 4001, 5, 66]


@pytest.fixture(scope="module")
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()


def _soft_prompt(hf_model, rows: int, seed: int) -> torch.Tensor:
    """Rows near the model's embeddings but no token's: what a tuned soft prompt looks like."""
    generator = torch.Generator().manual_seed(seed)
    table = hf_model.get_input_embeddings().weight.detach()
    picks = torch.randint(0, table.shape[0], (rows,), generator=generator)
    return table[picks] + 0.05 * torch.randn(rows, table.shape[1], generator=generator)


def _hf_greedy(hf_model, embeds: torch.Tensor) -> list[int]:
    """transformers' greedy continuation of a prompt given as `inputs_embeds`, each token
    it samples embedded by the model's own embedding module (scaled, for Gemma 3)."""
    embed = hf_model.get_input_embeddings()
    rows, out = embeds.clone(), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            token = int(hf_model(inputs_embeds=rows[None]).logits[0, -1].argmax())
            out.append(token)
            rows = torch.cat([rows, embed(torch.tensor([token]))])
    return out


def _engine(model: str, **options) -> LLM:
    options.setdefault("enforce_eager", True)
    return LLM(
        model=model,
        dtype="float32",
        max_model_len=256,
        block_size=16,
        enable_prompt_embeds=True,
        **options,
    )


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_a_soft_prompt_continues_as_transformers_continues_it(tiny_model, hf_model, enforce_eager):
    prompts = [_soft_prompt(hf_model, rows, seed) for rows, seed in ((37, 1), (1, 2), (16, 3))]
    engine = _engine(tiny_model, enforce_eager=enforce_eager)
    try:
        outputs = engine.generate([{"prompt_embeds": p} for p in prompts], GREEDY)
        for prompt, output in zip(prompts, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == _hf_greedy(hf_model, prompt)
            assert output.prompt is None
            assert len(output.prompt_token_ids) == prompt.shape[0]
    finally:
        engine.close()


def test_chunks_of_a_prompt_and_token_prompts_beside_it_run_as_alone(tiny_model, hf_model):
    # 8 tokens a step: the 37-row prompt runs in five chunks, among the others' steps.
    soft = _soft_prompt(hf_model, 37, 4)
    table = hf_model.get_input_embeddings().weight.detach()
    engine = _engine(
        tiny_model, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True
    )
    try:
        tokens, embedded, batched = engine.generate(
            [
                {"prompt_token_ids": TOKEN_PROMPT},
                {"prompt_embeds": soft[None]},  # [1, tokens, hidden] is taken as [tokens, hidden]
                {"prompt_embeds": table[TOKEN_PROMPT]},
            ],
            GREEDY,
        )
        assert list(embedded.outputs[0].token_ids) == _hf_greedy(hf_model, soft)
        expected = _hf_greedy(hf_model, table[TOKEN_PROMPT])
        assert list(tokens.outputs[0].token_ids) == list(batched.outputs[0].token_ids) == expected
    finally:
        engine.close()


def test_the_prefix_cache_keys_a_prompt_of_embeddings_by_its_rows(tiny_model, hf_model):
    engine = _engine(tiny_model)
    try:
        soft = _soft_prompt(hf_model, 40, 5)
        other = soft.clone()
        other[20] += 1.0  # the same placeholder tokens, another second block
        table = hf_model.get_input_embeddings().weight.detach()
        (first,) = engine.generate({"prompt_embeds": soft}, GREEDY)
        (again,) = engine.generate({"prompt_embeds": soft.clone()}, GREEDY)
        (changed,) = engine.generate({"prompt_embeds": other}, GREEDY)
        (placeholders,) = engine.generate({"prompt_token_ids": [0] * 40}, GREEDY)
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == 32
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert changed.num_cached_tokens == 16, "only the block before the changed row is shared"
        assert list(changed.outputs[0].token_ids) == _hf_greedy(hf_model, other)
        assert placeholders.num_cached_tokens == 0, "tokens never share a prompt's rows"
        assert list(placeholders.outputs[0].token_ids) == _hf_greedy(hf_model, table[[0] * 40])
    finally:
        engine.close()


def test_gemma_takes_the_rows_in_place_of_its_scaled_embeddings(tiny_gemma3_model):
    # transformers' Gemma 3 scales inside its embedding module, so its inputs_embeds are
    # the scaled rows: what vLLM's Gemma takes too.
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_model, torch_dtype=torch.float32)
    soft = _soft_prompt(hf_model, 21, 6) * hf_model.config.hidden_size**0.5
    engine = _engine(tiny_gemma3_model)
    try:
        (output,) = engine.generate({"prompt_embeds": soft}, GREEDY)
        assert list(output.outputs[0].token_ids) == _hf_greedy(hf_model, soft)
    finally:
        engine.close()


def test_penalties_count_no_placeholder_as_a_prompt_token():
    embeds = torch.zeros(3, 64)
    request = Request(
        request_id="r",
        prompt_token_ids=[0, 0, 0],
        sampling_params=SamplingParams(repetition_penalty=1.5),
        seed=0,
        eos_token_ids=frozenset(),
        max_tokens=4,
        prompt_embeds=embeds,
    )
    assert new_sequence(request).prompt_token_ids == []


@pytest.fixture(scope="module")
def embeds_engine(tiny_model):
    engine = _engine(tiny_model)
    yield engine
    engine.close()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        (torch.zeros(5, 32), GREEDY, "hidden_size 32 does not match the model's hidden_size 64"),
        (torch.zeros(64), GREEDY, "must be a 2D tensor of shape (num_tokens, hidden_size)"),
        (torch.zeros(2, 5, 64), GREEDY, "must be a 2D tensor"),
        (torch.zeros(5, 64, dtype=torch.int64), GREEDY, "dtype torch.int64 is not a floating"),
        (torch.full((5, 64), float("nan")), GREEDY, "not finite"),
        (torch.zeros(0, 64), GREEDY, "at least one token"),
        (torch.zeros(300, 64), GREEDY, "maximum context length is 256 tokens"),
        ([[0.0] * 64], GREEDY, "must be a torch.Tensor, got list"),
        (torch.zeros(5, 64), SamplingParams(prompt_logprobs=1), "prompt_logprobs is not"),
    ],
)
def test_what_the_engine_refuses(embeds_engine, prompt, params, message):
    with pytest.raises(InvalidRequest) as error:
        embeds_engine.generate({"prompt_embeds": prompt}, params)
    assert message in str(error.value)


def test_without_the_flag_embeddings_are_refused_naming_it(tiny_model):
    engine = LLM(model=tiny_model, dtype="float32", max_model_len=256, enforce_eager=True)
    try:
        with pytest.raises(InvalidRequest, match="You must set `--enable-prompt-embeds`"):
            engine.generate({"prompt_embeds": torch.zeros(5, 64)}, GREEDY)
    finally:
        engine.close()
