"""The pooling routes served for real: `python -m aioserve serve` on all-MiniLM-L6-v2,
started once for the module, against transformers and vLLM 0.32's recorded answers.

References: transformers' BertModel on the same folder, mean-pooled over the attention mask
and L2-normalized (computed here), vLLM's answers serving the same model
(vllm_samples/40-94), and the official openai client. The request reading, the answers'
shapes and the refusals are tested without a model in test_pooling_http.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.server.openai_helpers import client, post, sample, shape
from tests.server.serve_process import (
    fetch,
    read_metrics,
    serve_model,
)

MODEL = "minilm"
"""The name vLLM served the model under in the recorded samples."""
MAX_MODEL_LEN = 256
"""vLLM's context for MiniLM: sentence_bert_config.json's max_seq_length, not the 512
position embeddings (vllm_samples/60)."""
S1 = "The quick brown fox jumps over the lazy dog."
S2 = "A fast auburn fox leapt over a sleepy hound."
S3 = "Paris is the capital of France."
S4 = "Foxes are animals."
LONG = "hello " * 400


def body_of(name: str) -> Any:
    return sample(name)["response"]["body"]


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_folder)


@pytest.fixture(scope="module")
def minilm_server(minilm_folder, tmp_path_factory):
    """`python -m aioserve serve` on all-MiniLM-L6-v2 at float32, as vLLM's samples name it."""
    log = tmp_path_factory.mktemp("serve-minilm") / "serve.log"
    with serve_model(minilm_folder, MODEL, log, "--dtype", "float32", "--enforce-eager") as url:
        yield url


@pytest.fixture(scope="module")
def reference(minilm_folder, minilm_tokenizer):
    """transformers' BertModel: mean of the last hidden states over the attention mask,
    L2-normalized (sentence-transformers' Pooling + Normalize)."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(minilm_folder, torch_dtype=torch.float32).eval()

    def embed(texts: list[str]) -> torch.Tensor:
        batch = minilm_tokenizer(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    return embed


def assert_same_vectors(got: list[list[float]], expected: torch.Tensor) -> None:
    got_tensor = torch.tensor(got)
    assert got_tensor.shape == expected.shape
    cosines = F.cosine_similarity(got_tensor, expected, dim=-1)
    assert torch.all(cosines > 1 - 1e-3), cosines
    torch.testing.assert_close(got_tensor, expected, atol=1e-3, rtol=1e-3)


def test_models_and_tokenize_report_vllms_context(minilm_server):
    models = fetch("GET", minilm_server + "/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, MAX_MODEL_LEN)]
    tokenized = fetch("POST", minilm_server + "/tokenize", body={"prompt": S1}).json()
    assert tokenized == body_of("61_tokenize_pooling")


def test_embeddings_match_transformers_and_vllm(minilm_server, reference):
    reply = post(minilm_server, "/v1/embeddings", {"model": MODEL, "input": [S1, S2]})
    assert reply.status == 200, reply.body
    body = reply.json()
    recorded = body_of("41_embeddings_two")
    assert shape(body) == shape(recorded)
    assert body["usage"] == recorded["usage"]
    vectors = [item["embedding"] for item in body["data"]]
    assert_same_vectors(vectors, reference([S1, S2]))
    # vLLM computed in float16: close, not equal.
    assert_same_vectors(vectors, torch.tensor([d["embedding"] for d in recorded["data"]]))


def test_openai_client_embeddings_decode_base64(minilm_server, reference):
    """The client asks for base64 by default and decodes float32 bytes."""
    result = client(minilm_server).embeddings.create(model=MODEL, input=[S1, S3, ""])
    assert [item.index for item in result.data] == [0, 1, 2]
    assert_same_vectors([item.embedding for item in result.data], reference([S1, S3, ""]))
    assert result.usage.prompt_tokens == result.usage.total_tokens == 12 + 9 + 2
    raw = client(minilm_server).embeddings.create(model=MODEL, input=S1, encoding_format="float")
    assert_same_vectors([raw.data[0].embedding], reference([S1]))


def test_pooling_and_unnormalized_vectors(minilm_server, reference):
    pooled = post(minilm_server, "/pooling", {"model": MODEL, "input": S1}).json()
    assert shape(pooled) == shape(body_of("54_pooling"))
    assert_same_vectors([pooled["data"][0]["data"]], reference([S1]))
    raw = post(minilm_server, "/v1/embeddings", {"input": S1, "use_activation": False}).json()
    recorded = body_of("52_embeddings_use_activation_false")["data"][0]["embedding"]
    assert np.linalg.norm(raw["data"][0]["embedding"]) == pytest.approx(5.4238, abs=2e-3)
    assert raw["data"][0]["embedding"][:5] == pytest.approx(recorded[:5], abs=2e-3)


@pytest.mark.parametrize(
    "name",
    ["47_embeddings_truncate", "69_embeddings_truncate_minus_one", "78_embeddings_truncate_left"],
)
def test_truncated_prompts_embed_as_vllms(minilm_server, name):
    recorded = sample(name)
    reply = post(minilm_server, "/v1/embeddings", recorded["request"]["body"])
    assert reply.status == 200, reply.body
    expected = recorded["response"]["body"]
    assert reply.json()["usage"] == expected["usage"]
    got = reply.json()["data"][0]["embedding"]
    assert got == pytest.approx(expected["data"][0]["embedding"], abs=2e-3)  # float16 there


def test_score_and_rerank_are_cosines_of_the_reference(minilm_server, reference):
    vectors = reference([S1, S2, S3, S4])
    expected = [F.cosine_similarity(vectors[0], v, dim=0).item() for v in vectors[1:]]
    score = post(minilm_server, "/score", {"model": MODEL, "text_1": S1, "text_2": [S2, S3]})
    got = [item["score"] for item in score.json()["data"]]
    assert got == pytest.approx(expected[:2], abs=1e-3)
    recorded = [item["score"] for item in body_of("55_score")["data"]]
    assert got == pytest.approx(recorded, abs=2e-3)
    rerank = post(minilm_server, "/v1/rerank", {"model": MODEL, "query": S1, "documents": [S2, S3, S4], "top_n": 2})  # fmt: skip
    results = rerank.json()["results"]
    assert [r["index"] for r in results] == [0, 2]  # as vLLM ranked them (sample 56)
    assert [r["relevance_score"] for r in results] == pytest.approx([expected[0], expected[2]], abs=1e-3)  # fmt: skip


def test_generation_routes_are_not_served(minilm_server):
    """vLLM does not register them for a pooling model: 404 (samples 58 and 59)."""
    completion = post(minilm_server, "/v1/completions", {"model": MODEL, "prompt": "Hi"})
    chat = post(
        minilm_server,
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert completion.status == chat.status == 404


def test_metrics_count_each_pooled_text_as_a_finished_request(minilm_server):
    """As vLLM's (sample 62): success with finished_reason "stop" and prompt tokens per text,
    no generation tokens; the vector timed as the first token, no max_tokens sent, and 0 s
    per output token."""

    def value(samples, name, **labels):
        return sum(
            s.value for s in samples if s.name == name and labels.items() <= s.labels.items()
        )

    before = read_metrics(minilm_server)
    assert post(minilm_server, "/v1/embeddings", {"input": [S1, S2, S3]}).status == 200
    after = read_metrics(minilm_server)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("vllm:request_success_total", finished_reason="stop") == 3
    assert moved("vllm:prompt_tokens_total") == 12 + 12 + 9
    assert moved("vllm:generation_tokens_total") == 0
    assert moved("vllm:e2e_request_latency_seconds_count") == 3
    assert moved("vllm:time_to_first_token_seconds_count") == 3
    assert moved("vllm:request_params_max_tokens_count") == 0
    assert moved("vllm:request_time_per_output_token_seconds_count") == 3
    assert moved("vllm:request_time_per_output_token_seconds_sum") == 0
    assert moved("vllm:inter_token_latency_seconds_count") == 0
