"""A generative decoder served as an embedding model (vLLM's --convert embed,
runner/decoder_pooling.py): a tiny random Qwen3 laid out as Qwen3-Embedding is (a
Qwen3ForCausalLM with sentence-transformers' modules.json: last-token pooling, then
Normalize), and the tiny Llama under --runner pooling, against transformers' own hidden
states pooled the same way. A prompt's vector must not depend on the prompts beside it:
the decoder attends causally within each prompt of the packed step.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from aioserve.engine.llm import LLM

PROMPTS = [
    [504, 3575, 282, 4649, 314, 7, 9, 11, 260, 1030, 77],
    [1, 2000, 300, 44, 5, 60, 70, 800, 9000, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [42],
    [7, 8, 9, 10, 11],
]


@pytest.fixture(scope="module")
def qwen3_embedding(smollm2_gguf, tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from aioserve.models.checkpoint import open_checkpoint

    folder = tmp_path_factory.mktemp("tiny-qwen3-embedding")
    tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
    tokenizer.save_pretrained(folder)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        architectures=["Qwen3ForCausalLM"],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(folder)


def _hidden_states(folder: str, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden states of `prompt` alone, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def _embed(folder: str, **options) -> torch.Tensor:
    with LLM(folder, dtype="float32", max_model_len=64, **options) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        alone = llm.embed([{"prompt_token_ids": PROMPTS[1]}], use_tqdm=False)
    assert torch.equal(outputs[1].outputs.data, alone[0].outputs.data)  # batch-independent
    return torch.stack([o.outputs.data for o in outputs])


def test_a_sentence_transformers_decoder_embeds_as_its_files_say(qwen3_embedding):
    got = _embed(qwen3_embedding)  # runner auto: its Pooling module makes it a pooling model
    expected = torch.stack([_hidden_states(qwen3_embedding, p)[-1] for p in PROMPTS])
    torch.testing.assert_close(got, F.normalize(expected, dim=-1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("options", "pool"),
    [
        ({"runner": "pooling"}, "LAST"),
        ({"runner": "pooling", "model_impl": "transformers"}, "LAST"),  # the backend's decoder
        ({"convert": "embed", "override_pooler_config": {"pooling_type": "MEAN"}}, "MEAN"),
    ],
)
def test_a_generative_model_converted_to_embeddings(tiny_model, options, pool):
    got = _embed(tiny_model, **options)
    rows = [_hidden_states(tiny_model, p) for p in PROMPTS]
    pooled = torch.stack([r[-1] if pool == "LAST" else r.mean(0) for r in rows])
    torch.testing.assert_close(got, F.normalize(pooled, dim=-1), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"runner": "pooling", "convert": "none"}, "--convert none keeps it one"),
        ({"runner": "generate", "convert": "embed"}, "converted to embeddings"),
        ({"convert": "classify"}, "conversion 'classify' is not supported by aioserve yet"),
    ],
)
def test_conversions_it_cannot_make_are_refused(tiny_model, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, **options)


def test_without_conversion_the_decoder_generates(tiny_model):
    from aioserve import SamplingParams

    with LLM(tiny_model, dtype="float32", max_model_len=64, enforce_eager=True) as llm:
        [out] = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2))
        assert len(out.outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match="embed"):
            llm.embed([{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False)
