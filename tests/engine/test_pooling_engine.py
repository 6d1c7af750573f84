"""A pooling model through the engine: all-MiniLM-L6-v2's vectors against transformers',
the pooler's per-request options, the requests' checks, and the engine's bookkeeping."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.llm import LLM
from aioserve.engine.pooling_params import PoolingParams, finish_vector
from aioserve.engine.sampling_params import SamplingParams
from aioserve.models.pooler import PoolerConfig
from tests.models.tiny_models import hf_bert_and_ours, tiny_roberta_config

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome",
    "Embeddings turn sentences into vectors that can be compared with a cosine; "
    "this one is longer than the others, so that the batch holds prompts of several lengths.",
    "x",
]


@pytest.fixture(scope="module")
def llm(minilm_folder):
    with LLM(str(minilm_folder), dtype="float32", max_num_seqs=3) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(minilm_folder):
    """transformers' BertModel on the same folder, pooled as sentence-transformers pools:
    the mean of the last hidden states over the prompt's tokens, unnormalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    model = AutoModel.from_pretrained(minilm_folder, torch_dtype=torch.float32).eval()

    def embed(texts: list[str]) -> torch.Tensor:
        batch = tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return (hidden * mask).sum(1) / mask.sum(1)

    return embed


def test_vectors_match_transformers_mean_pooled_and_normalized(llm, reference):
    outputs = llm.embed(TEXTS, use_tqdm=False)
    expected = F.normalize(reference(TEXTS), dim=-1)
    got = torch.stack([o.data for o in outputs])
    assert got.shape == expected.shape == (len(TEXTS), 384)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert outputs[0].outputs.embedding == pytest.approx(expected[0].tolist(), abs=2e-5)
    assert [o.prompt_token_ids for o in outputs] == [
        llm.get_tokenizer()(t).input_ids for t in TEXTS
    ]


def test_bfloat16_vectors_keep_their_direction(minilm_folder, reference):
    """bfloat16, on a CPU with bfloat16 arithmetic with the dense layers' weights packed for
    oneDNN (resolution.resolve_packed_weights)."""
    with LLM(str(minilm_folder), dtype="bfloat16") as bf16:
        got = torch.stack([o.data for o in bf16.embed(TEXTS, use_tqdm=False)])
    cosines = F.cosine_similarity(got, F.normalize(reference(TEXTS), dim=-1), dim=-1)
    assert (cosines > 0.999).all(), cosines


def test_normalize_false_gives_the_plain_mean(llm, reference):
    (output,) = llm.embed(TEXTS[1], PoolingParams(use_activation=False), use_tqdm=False)
    expected = reference([TEXTS[1]])[0]
    torch.testing.assert_close(output.data, expected, atol=2e-5, rtol=1e-4)
    assert output.data.norm().item() == pytest.approx(expected.norm().item(), rel=1e-4)
    assert output.data.norm().item() != pytest.approx(1.0, abs=1e-3)


def test_a_vector_does_not_depend_on_its_batch(llm):
    alone = llm.embed(TEXTS[2], use_tqdm=False)[0].data
    together = llm.embed(TEXTS * 3, use_tqdm=False)
    for output in together[2::4]:
        torch.testing.assert_close(output.data, alone, atol=1e-6, rtol=1e-5)


def test_score_is_the_cosine_of_the_two_vectors(llm):
    scores = llm.score(TEXTS[0], TEXTS[1:3], use_tqdm=False)
    vectors = [o.data for o in llm.embed(TEXTS[:3], use_tqdm=False)]
    assert [s.outputs.score for s in scores] == pytest.approx(
        [F.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:3]], abs=1e-6
    )
    with pytest.raises(ValueError, match="pairs 2 texts with 3"):
        llm.score(TEXTS[:2], TEXTS[:3])
    with pytest.raises(ValueError, match="At least one text_pair element must be given"):
        llm.score(TEXTS[0], [])


def test_prompts_as_long_as_the_context_run_and_longer_ones_are_refused(llm):
    settings = llm.engine.settings
    assert settings.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    assert settings.runner_type == "pooling" and settings.pooler.pooling_type == "MEAN"
    longest = {"prompt_token_ids": [101] + [1037] * 254 + [102]}
    (output,) = llm.encode(longest, use_tqdm=False)
    assert len(output.prompt_token_ids) == 256 and torch.isfinite(output.data).all()
    with pytest.raises(
        InvalidRequest,
        match="maximum context length is 256 tokens. However, your prompt contains 257 input tokens",
    ):
        llm.encode({"prompt_token_ids": [101] * 257}, use_tqdm=False)


def test_dimensions_are_refused_for_a_model_that_is_not_matryoshka(llm):
    with pytest.raises(
        InvalidRequest,
        match="does not support Matryoshka embeddings; dimensions must be unset \\(received dimensions=32\\)",
    ):
        llm.embed(TEXTS[0], PoolingParams(dimensions=32), use_tqdm=False)


def test_a_pooling_engine_does_not_generate(llm):
    with pytest.raises(ValueError, match="runner is 'pooling': it cannot generate text"):
        llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)


def test_every_block_returns_after_finished_and_cancelled_requests(llm):
    engine = llm.engine

    async def run() -> None:
        tasks = [
            asyncio.ensure_future(engine.encode(TEXTS[i % 4], PoolingParams(), f"cancel-{i}"))
            for i in range(12)
        ]
        await asyncio.sleep(0)
        for task in tasks[::2]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert sum(isinstance(r, asyncio.CancelledError) for r in results) == 6
        assert all(r.data.shape == (384,) for r in results[1::2])
        await engine.stop_loop()

    llm._loop.run_until_complete(run())
    assert engine.num_unfinished_requests == 0
    assert engine.kv_cache.num_free_blocks == engine.settings.num_blocks
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"runner": "generate"}, "--runner generate: BertModel is an encoder-only model"),
        ({"task": "generate"}, "--runner generate: BertModel is an encoder-only model"),
        ({"runner": "pooling", "task": "generate"}, "--task generate contradicts --runner pooling"),
        ({"max_model_len": 300}, "--max-model-len 300 is larger than the model's maximum context length 256"),
        ({"max_num_batched_tokens": 128}, "smaller than --max-model-len \\(256\\)"),
        ({"override_pooler_config": {"pooling_type": "MAX"}}, "MAX"),
    ],
)  # fmt: skip
def test_settings_a_pooling_model_cannot_have_are_refused(minilm_folder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(minilm_folder), **kwargs)


def test_a_vector_is_cut_then_normalized_as_the_request_or_else_the_pooler_says():
    pooled = torch.tensor([3.0, 4.0, 12.0])
    normalizing = PoolerConfig("MEAN", normalize=True)
    torch.testing.assert_close(finish_vector(pooled, PoolingParams(), normalizing), pooled / 13)
    torch.testing.assert_close(
        finish_vector(pooled, PoolingParams(dimensions=2), normalizing), torch.tensor([0.6, 0.8])
    )
    off = PoolingParams(use_activation=False)
    torch.testing.assert_close(finish_vector(pooled, off, normalizing), pooled)
    cut_by_default = PoolerConfig("MEAN", normalize=False, dimensions=2)
    torch.testing.assert_close(
        finish_vector(pooled, PoolingParams(), cut_by_default), torch.tensor([3.0, 4.0])
    )
    torch.testing.assert_close(
        finish_vector(pooled, PoolingParams(dimensions=1, use_activation=True), cut_by_default),
        torch.tensor([1.0]),
    )


def test_an_xlm_roberta_folder_pools_its_cls_row_within_its_positions(tmp_path):
    """A folder without sentence-transformers files: vLLM's default pooler (CLS,
    normalized), and a context of the position table less RoBERTa's offset."""
    hf, _ = hf_bert_and_ours(tiny_roberta_config("XLMRobertaModel"))
    hf.save_pretrained(tmp_path)
    tokens = [0, 5, 6, 7, 2]
    with LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32") as roberta:
        settings = roberta.engine.settings
        assert settings.max_model_len == 128
        assert settings.pooler == PoolerConfig("CLS", normalize=True)
        (output,) = roberta.embed({"prompt_token_ids": tokens}, use_tqdm=False)
        with pytest.raises(InvalidRequest, match="maximum context length is 128 tokens"):
            roberta.embed({"prompt_token_ids": [5] * 129}, use_tqdm=False)
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([tokens])).last_hidden_state[0, 0]
    torch.testing.assert_close(output.data, F.normalize(expected, dim=-1), atol=1e-5, rtol=1e-5)


def test_the_steps_report_no_kv_cache_in_use(minilm_folder):
    """The scheduler's blocks are bookkeeping only: vLLM reports 0 for a pooling model.
    With two steps in flight, one prompt a step, the next step holds blocks whenever one
    is reported."""
    usages = []

    class Recorder:
        def record(self, stats) -> None:
            usages.append(stats.kv_cache_usage)

    prompt = {"prompt_token_ids": [101] + [1037] * 198 + [102]}
    with LLM(str(minilm_folder), max_num_batched_tokens=256, async_scheduling=True) as llm:
        llm.engine.stat_loggers.append(Recorder())
        llm.embed([prompt] * 4, use_tqdm=False)
    assert len(usages) >= 4 and set(usages) == {0.0}
