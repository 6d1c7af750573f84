"""--compilation-config and --optimization-level in a built engine: level 0 runs the model
step eagerly, exact capture sizes pad the decodes to those sizes (under -O0 too),
cudagraph_mode NONE pads none; each engine's greedy tokens are transformers' on the same
weights.

The values the flags take and refuse are tests/config/test_compilation_config.py's and
tests/config/test_optimization_level.py's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from aioserve import LLM, SamplingParams
from tests.models.tiny_models import save_tiny_model, tiny_llama_config
from tests.runner.plans import record_padded_sizes

PROMPTS = [[5, 17, 99, 3, 42, 7], [8, 1, 200], [31, 64, 2, 2, 90, 11, 13]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def hf_tokens(tiny_folder) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, float32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, torch_dtype=torch.float32)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            tokens = list(prompt)
            for _ in range(NEW_TOKENS):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            out.append(tokens[len(prompt) :])
    return out


def _engine(folder, **options) -> LLM:
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=256,
        block_size=16,
        max_num_seqs=8,
        skip_tokenizer_init=True,
        **options,
    )


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": prompt} for prompt in PROMPTS]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "level_0", [{"compilation_config": 0}, {"optimization_level": 0}], ids=["cc", "O"]
)
def test_level_0_runs_the_step_eagerly(tiny_folder, hf_tokens, level_0):
    """--compilation-config 0 and --optimization-level 0 alike (the latter without graphs
    by its own rule, the former because the CPU captures none by default)."""
    llm = _engine(tiny_folder, **level_0)
    try:
        assert not llm.engine.runner.model_step.compiled
        assert llm.engine.runner.decode_graphs is None
        assert _greedy(llm) == hf_tokens
    finally:
        llm.close()


def test_exact_capture_sizes_pad_the_decodes(tiny_folder, hf_tokens):
    llm = _engine(tiny_folder, compilation_config={"level": 0, "cudagraph_capture_sizes": [4]})
    try:
        assert llm.engine.runner.decode_graphs.sizes == [4]
        padded = record_padded_sizes(llm.engine.runner)
        assert _greedy(llm) == hf_tokens
        assert set(padded) == {4}  # three decodes a step, padded to 4
    finally:
        llm.close()


def test_cudagraph_mode_none_pads_nothing(tiny_folder, hf_tokens):
    llm = _engine(
        tiny_folder,
        cuda_graph_sizes=[4],
        compilation_config={"level": 0, "cudagraph_mode": "NONE"},
    )
    try:
        assert llm.engine.runner.decode_graphs is None
        assert _greedy(llm) == hf_tokens
    finally:
        llm.close()


def test_optimization_level_0_pads_to_the_sizes_given(tiny_folder, hf_tokens):
    llm = _engine(tiny_folder, optimization_level=0, cudagraph_capture_sizes=[4])
    try:
        assert not llm.engine.runner.model_step.compiled
        assert llm.engine.runner.decode_graphs.sizes == [4]
        padded = record_padded_sizes(llm.engine.runner)
        assert _greedy(llm) == hf_tokens
        assert set(padded) == {4}
    finally:
        llm.close()
