"""The pooling routes (/v1/embeddings, /pooling, /score, /rerank) against vLLM 0.32's answers.

References: vLLM 0.32's recorded answers serving all-MiniLM-L6-v2 (vllm_samples/40-94:
shapes, error texts, token counts, scores), and transformers' BertModel on the same folder,
mean-pooled over the attention mask and L2-normalized (computed here).

Two layers, cheapest first:
- the request reading and answer building, with plain values;
- the handlers in-process on a stand-in engine (`StubEngine`: the real tokenizer, a
  bag-of-tokens vector, the engine's own checks), for what does not need the model: errors,
  ids, usage, truncation, load shedding;
- a real `python -m aioserve serve` on MiniLM is test_pooling_served.py's, for the vectors
  and scores against transformers and the official openai client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from aiohttp import web

from aioserve.config.frontend import frontend_config
from aioserve.engine.load_shedding import LoadShedder
from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams, check_pooling_request
from aioserve.models.pooler import PoolerConfig
from aioserve.server.body_fields import BodyFields
from aioserve.server.embeddings import (
    Encoding,
    pooling_response,
    read_inputs,
)
from aioserve.server.errors import APIError, error_middleware
from aioserve.server.pooling_requests import COMMON_BODY
from aioserve.server.pooling_routes import add_pooling_routes
from aioserve.server.prompt_truncation import read_truncation
from aioserve.server.responses import ResponseHead
from aioserve.server.scoring import (
    check_side_lengths,
    pair_scores,
    rerank_response,
    score_response,
    truncate_text,
)
from aioserve.server.state import STATE, ServerState
from tests.server.conftest import serve_app
from tests.server.openai_helpers import post, sample, shape
from tests.server.serve_process import (
    openai_error,
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


# --- reading requests and building answers, with plain values --------------------------------


def test_inputs_are_read_as_vllm_reads_them():
    assert read_inputs({"input": S1}).prompts == [S1]
    assert read_inputs({"input": ""}).prompts == [""]  # vLLM: [CLS][SEP] (sample 48)
    assert read_inputs({"input": [S1, S2]}).prompts == [S1, S2]
    assert read_inputs({"input": [101, 7592, 102]}).prompts == [[101, 7592, 102]]
    assert read_inputs({"input": [[101], [102, 103]]}).prompts == [[101], [102, 103]]
    chat = [{"role": "user", "content": S1}]
    assert read_inputs({"input": chat}).conversations == [chat]
    assert read_inputs({"messages": chat}).conversations == [chat]
    assert read_inputs({"messages": [chat, chat]}).conversations == [chat, chat]
    assert len(read_inputs({"input": [S1, S2, S3]})) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "You must pass at least one prompt"),  # vLLM's (sample 49)
        ({"input": 5}, "input must be a string"),
        ({"input": [S1, [101]]}, "input must be a string"),
        ({"input": [True]}, "input must be a string"),
        ({}, "the field `input` (or `messages`) is required"),
        ({"messages": []}, "messages must be a non-empty array"),
    ],
)
def test_bad_inputs_are_refused(body, message):
    with pytest.raises(APIError) as caught:
        read_inputs(body)
    assert caught.value.status == 400
    assert message in caught.value.message


def test_vectors_encode_as_vllm_and_the_openai_client_decode_them():
    vector = torch.tensor([0.5, -1.25, 3.0e-3, 7.0])
    as_float = Encoding("float").json_value(vector)
    assert as_float == [0.5, -1.25, pytest.approx(3.0e-3), 7.0]
    # base64 of float32 little-endian bytes: what openai decodes with np.frombuffer.
    encoded = Encoding("base64").json_value(vector)
    assert np.frombuffer(base64.b64decode(encoded), dtype="float32").tolist() == as_float
    big = Encoding("base64", "float32", "big").json_value(vector)
    assert np.frombuffer(base64.b64decode(big), dtype=">f4").tolist() == as_float
    half = Encoding("base64", "float16").raw(vector)
    assert np.frombuffer(half, dtype="float16").tolist() == vector.half().tolist()
    bf16 = Encoding("base64", "bfloat16").raw(vector)
    decoded = torch.frombuffer(bytearray(bf16), dtype=torch.bfloat16)
    assert decoded.tolist() == vector.bfloat16().tolist()
    assert len(Encoding("base64", "fp8_e4m3").raw(vector)) == 4


def test_the_recorded_base64_vector_is_the_recorded_float_vector():
    """vLLM's base64 (sample 44) is the float32 bytes of its float answer (sample 41)."""
    floats = [item["embedding"] for item in body_of("41_embeddings_two")["data"]]
    for item, expected in zip(body_of("44_embeddings_base64")["data"], floats, strict=True):
        got = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        assert got.tolist() == pytest.approx(expected, abs=1e-6)
        assert Encoding("base64").json_value(torch.tensor(expected)) == item["embedding"]


def _outputs(*vectors: list[float], tokens: int = 3) -> list[PoolingRequestOutput]:
    return [
        PoolingRequestOutput(f"r-{i}", list(range(tokens)), torch.tensor(v))
        for i, v in enumerate(vectors)
    ]


def test_answers_have_vllm_keys_in_vllm_order():
    head = ResponseHead("embd-x", "list", MODEL, 1)
    answer = pooling_response(head, _outputs([1.0, 0.0], [0.0, 1.0]), Encoding())
    assert shape(answer) == shape(body_of("41_embeddings_two"))
    assert answer["usage"] == {**body_of("41_embeddings_two")["usage"], "prompt_tokens": 6, "total_tokens": 6}  # fmt: skip
    pooled = pooling_response(head, _outputs([1.0]), Encoding(), "pooling", "data")
    assert shape(pooled) == shape(body_of("54_pooling"))
    scored = score_response(ResponseHead("score-x", "list", MODEL, 1), [0.5, 0.25], 33)
    assert shape(scored) == shape(body_of("55_score"))
    reranked = rerank_response(head, [S2, S3, S4], [0.6, 0.04, 0.59], 2, 39)
    assert shape(reranked) == shape(body_of("56_rerank_v1"))


def test_rerank_sorts_by_relevance_and_keeps_top_n():
    head = ResponseHead("score-x", "list", MODEL, 1)
    documents, scores = [S2, S3, S4], [0.6339538097381592, 0.042925380170345306, 0.59410876]
    answer = rerank_response(head, documents, scores, 2, 39)
    # vLLM's answer to the same scores (sample 56): indexes 0 then 2, top_n=2.
    recorded = body_of("56_rerank_v1")["results"]
    assert [r["index"] for r in answer["results"]] == [r["index"] for r in recorded] == [0, 2]
    assert answer["results"][0]["document"] == {"text": S2, "multi_modal": None}
    assert answer["usage"] == {"prompt_tokens": 39, "total_tokens": 39}
    for top_n in (0, 3, 10):  # 0: all; past the documents: all
        every = rerank_response(head, documents, scores, top_n, 39)["results"]
        assert [r["index"] for r in every] == [0, 2, 1]
    ties = rerank_response(head, ["a", "b", "c"], [0.5, 0.9, 0.5], 0, 3)["results"]
    assert [r["index"] for r in ties] == [1, 0, 2]  # equal scores keep their order


def test_pair_scores_are_cosines_one_to_many_and_pairwise():
    q = torch.tensor([1.0, 0.0])
    d1, d2 = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    assert pair_scores([q], [d1, d2]) == pytest.approx([1.0, math.sqrt(0.5)])
    assert pair_scores([q, d2], [d2, d2]) == pytest.approx([math.sqrt(0.5), 1.0])


@pytest.mark.parametrize(
    ("queries", "documents", "message"),
    [
        ([S1, S2], [S1, S2, S3], "Input lengths must be either 1:1, 1:N or N:N"),
        ([], [S1], "At least one text element must be given"),
        ([S1], [], "At least one text_pair element must be given"),
    ],
)
def test_side_lengths_are_checked_with_vllm_messages(queries, documents, message):
    with pytest.raises(APIError) as caught:
        check_side_lengths(queries, documents)
    assert caught.value.message == message


def test_truncation_keeps_the_whole_context_for_minus_one_and_the_first_tokens():
    def read(**body):
        return read_truncation(BodyFields(body, COMMON_BODY), MAX_MODEL_LEN, pooling=True)

    assert read() is None
    minus_one = read(truncate_prompt_tokens=-1)
    assert (minus_one.keep, minus_one.side) == (MAX_MODEL_LEN, "right")  # sample 69: 256
    assert read(truncate_prompt_tokens=3).apply([1, 2, 3, 4, 5]) == [1, 2, 3]
    left = read(truncate_prompt_tokens=3, truncation_side="left")
    assert left.apply([1, 2, 3, 4, 5]) == [3, 4, 5]
    with pytest.raises(APIError) as caught:
        read(truncate_prompt_tokens=1000)
    assert caught.value.message.startswith(
        "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller "
        "truncation size."  # vLLM's (sample 68)
    )


def test_texts_are_cut_to_a_token_budget_at_a_character_boundary(minilm_tokenizer):
    cut = truncate_text(minilm_tokenizer, S1, 4)
    assert cut == "The quick brown fox"
    assert len(minilm_tokenizer(cut, add_special_tokens=False).input_ids) == 4
    assert truncate_text(minilm_tokenizer, S1, 100) == S1
    assert truncate_text(minilm_tokenizer, S1, 0) == ""


# --- the handlers on a stand-in engine ------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_tokenizer(minilm_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_folder)


@dataclass
class _StubScheduler:
    num_waiting: int = 0
    num_running: int = 0
    num_prefill_tokens: int = 0


@dataclass
class StubEngine:
    """What the pooling handlers use of an AsyncEngine, with a cheap vector: each token
    adds one to the slot `id % 384`, normalized unless use_activation is false."""

    tokenizer: Any
    max_num_queued_reqs: int | None = None
    hang: bool = False
    """Never answer (until cancelled), to see requests aborted."""
    calls: list[tuple[str, list[int], PoolingParams, int]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.settings = SimpleNamespace(
            max_model_len=MAX_MODEL_LEN,
            served_model_names=[MODEL],
            model_name=MODEL,
            pooled_size=384,
            matryoshka_dimensions=None,
            runner_type="pooling",
            pooler=PoolerConfig("MEAN", normalize=True),
        )
        self.hf_config = SimpleNamespace(vocab_size=30522, architectures=["BertModel"])
        self.load_shedder = LoadShedder(_StubScheduler(), self.max_num_queued_reqs, None)

    async def encode(self, prompt, params, request_id, *, priority=0) -> PoolingRequestOutput:
        self.load_shedder.check(1)
        token_ids = prompt["prompt_token_ids"]
        check_pooling_request(self.settings, self.hf_config.vocab_size, token_ids, params)
        self.calls.append((request_id, token_ids, params, priority))
        try:
            await asyncio.sleep(3600 if self.hang else 0)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        vector = torch.full((384,), 0.01)
        for token_id in token_ids:
            vector[token_id % 384] += 1.0
        if params.use_activation is not False:
            vector = F.normalize(vector, dim=0)
        return PoolingRequestOutput(request_id, list(token_ids), vector)


@contextmanager
def stub_server(server_loop, engine: StubEngine):
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = ServerState(engine, [MODEL])
    add_pooling_routes(app)
    with serve_app(server_loop, app) as url:
        yield url


@pytest.fixture(scope="module")
def stub(minilm_tokenizer, server_loop):
    engine = StubEngine(minilm_tokenizer)
    with stub_server(server_loop, engine) as url:
        yield SimpleNamespace(url=url, engine=engine)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


def test_embeddings_count_tokens_and_name_requests_as_vllm(stub, minilm_tokenizer):
    stub.engine.calls.clear()
    reply = post(
        stub.url, "/v1/embeddings", {"model": MODEL, "input": [S1, ""], "request_id": "r1"}
    )
    assert reply.status == 200, reply.body
    body = reply.json()
    recorded = body_of("72_embeddings_list_with_empty")
    assert shape(body) == shape(recorded)
    assert body["usage"] == recorded["usage"]  # 12 + 2 tokens
    assert body["id"] == "embd-r1"
    assert sorted(call[0] for call in stub.engine.calls) == ["embd-r1-0", "embd-r1-1"]
    assert stub.engine.calls[0][1] == _tokens(minilm_tokenizer, S1)


def test_token_id_inputs_and_special_tokens(stub):
    stub.engine.calls.clear()
    reply = post(stub.url, "/v1/embeddings", {"input": [[101, 7592, 2088, 102], [101, 7592, 102]]})
    assert reply.json()["usage"] == body_of("43_embeddings_token_id_lists")["usage"]
    reply = post(stub.url, "/v1/embeddings", {"input": S1, "add_special_tokens": False})
    assert reply.json()["usage"]["prompt_tokens"] == 10  # without [CLS] and [SEP]


def test_pooling_answers_with_its_own_id_and_objects(stub):
    reply = post(stub.url, "/pooling", {"model": MODEL, "input": S1, "encoding_format": "base64"})
    body = reply.json()
    assert reply.status == 200
    assert body["id"].startswith("pooling-")
    assert body["data"][0]["object"] == "pooling"
    assert len(base64.b64decode(body["data"][0]["data"])) == 384 * 4


@pytest.mark.parametrize(
    ("path", "body", "sample_name"),
    [
        ("/v1/embeddings", {"input": LONG}, "46_err_embeddings_too_long"),
        ("/v1/embeddings", {"input": [101] + [7592] * 300 + [102]}, "79_err_embeddings_too_long_ids"),
        ("/v1/embeddings", {"input": S1, "normalize": False}, "51_err_embeddings_normalize"),
        ("/v1/embeddings", {"input": []}, "49_err_embeddings_empty_list"),
        ("/v1/embeddings", {"input": S1, "dimensions": 128}, "45_err_embeddings_dimensions"),
        ("/v1/embeddings", {"input": [101, 99999, 102]}, "74_err_embeddings_token_out_of_vocab"),
        ("/v1/embeddings", {"input": S1, "truncate_prompt_tokens": 1000}, "68_err_embeddings_truncate_too_big"),
        ("/pooling", {"input": S1, "dimensions": 8}, "70_err_pooling_dimensions"),
        ("/score", {"text_1": [S1, S2], "text_2": [S1, S2, S1]}, "65_err_score_lengths"),
        ("/score", {"text_1": S1, "text_2": []}, "87_err_score_empty_docs"),
        ("/rerank", {"query": S1, "documents": [S2, LONG]}, "88_err_rerank_too_long_doc"),
    ],
)  # fmt: skip
def test_refusals_read_as_vllm_words_them(stub, path, body, sample_name):
    """Status and message as vLLM's, "at least 257" included for a text tokenized no
    further than one token past the context; aioserve adds "(parameter=..., value=...)"
    where a field is at fault."""
    reply = post(stub.url, path, {"model": MODEL, **body})
    recorded = body_of(sample_name)["error"]
    assert reply.status == recorded["code"] == 400
    error = openai_error(reply)
    expected = recorded["message"].split(" (parameter=")[0]
    assert error["message"].startswith(expected), (error["message"], expected)


def test_other_refusals(stub):
    unknown = post(stub.url, "/v1/embeddings", {"model": "nope", "input": S1})
    assert unknown.status == 404  # vLLM's (sample 66)
    assert openai_error(unknown)["message"].startswith("The model `nope` does not exist.")
    chat = post(stub.url, "/v1/embeddings", {"messages": [{"role": "user", "content": S1}]})
    assert chat.status == 400  # no chat template (vLLM: sample 53)
    assert "chat template" in openai_error(chat)["message"]
    for body in (
        {"input": S1, "encoding_format": "hex"},
        {"input": S1, "embed_dtype": "int8"},
        {"input": S1, "use_activation": "x"},
        {"input": S1, "padding": "max_length"},
        {"input": S1, "priority": "high"},
    ):
        assert post(stub.url, "/v1/embeddings", body).status == 400, body
    task = post(stub.url, "/pooling", {"input": S1, "task": "classify"})
    assert openai_error(task)["message"] == (
        "Unsupported task: 'classify' Supported tasks: ['embed'] (parameter=task)"
    )
    assert post(stub.url, "/rerank", {"query": S1, "documents": [S2], "top_n": -1}).status == 400
    assert post(stub.url, "/rerank", {"documents": [S2]}).status == 400
    assert post(stub.url, "/score", {"text_1": S1}).status == 400
    mm = post(stub.url, "/score", {"text_1": S1, "text_2": {"content": []}})
    assert openai_error(mm)["message"] == "MultiModalParam is not supported for BertModel"


def test_a_requests_chat_template_renders_with_the_flag_only(stub, minilm_tokenizer, server_loop):
    """vLLM's pooling chat requests take `chat_template` (pooling/base/protocol.py), checked
    by the same untrusted-template rule as chat (pooling/base/io_processor.py)."""
    chat = {"messages": [{"role": "user", "content": S1}], "chat_template": "{{ messages[0].content }}!"}  # fmt: skip
    refused = post(stub.url, "/v1/embeddings", chat)
    assert openai_error(refused)["message"] == (
        "Chat template is passed with request, but --trust-request-chat-template is not set. "
        "Refused request with untrusted chat template."
    )
    app = web.Application(middlewares=[error_middleware])
    frontend = frontend_config(trust_request_chat_template=True)
    app[STATE] = ServerState(stub.engine, [MODEL], frontend=frontend)
    add_pooling_routes(app)
    with serve_app(server_loop, app) as url:
        for path in ("/v1/embeddings", "/pooling"):
            stub.engine.calls.clear()
            reply = post(url, path, chat)
            assert reply.status == 200, reply.body
            rendered = minilm_tokenizer(S1 + "!", add_special_tokens=False).input_ids
            assert [call[1] for call in stub.engine.calls] == [rendered]


def test_truncation_without_a_side_keeps_the_special_tokens(stub, minilm_tokenizer):
    """As vLLM: without `truncation_side` a text is cut by the tokenizer, which keeps [CLS]
    and [SEP]; with a side, and for token ids, the tokens are sliced (sample 78's vector is
    the last 10 tokens': no [CLS])."""
    stub.engine.calls.clear()
    post(stub.url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 10})
    post(stub.url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": -1})
    cut, whole = [call[1] for call in stub.engine.calls]
    assert cut == [101] + [7592] * 8 + [102]
    assert len(whole) == MAX_MODEL_LEN and whole[-1] == 102  # sample 69: 256 prompt tokens
    stub.engine.calls.clear()
    post(stub.url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 10, "truncation_side": "left"})  # fmt: skip
    post(stub.url, "/v1/embeddings", {"input": LONG, "truncate_prompt_tokens": 10, "truncation_side": "right"})  # fmt: skip
    ids = _tokens(minilm_tokenizer, LONG)
    post(stub.url, "/v1/embeddings", {"input": ids, "truncate_prompt_tokens": 10})
    left, right, sliced_ids = [call[1] for call in stub.engine.calls]
    assert left == ids[-10:] and right == ids[:10] and sliced_ids == ids[:10]


def test_a_prompt_may_fill_the_context(stub):
    reply = post(stub.url, "/v1/embeddings", {"input": [101] + [7592] * 254 + [102]})
    assert reply.status == 200  # vLLM too (sample 80)
    assert reply.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_score_and_rerank_count_each_text_once(stub):
    score = post(stub.url, "/score", {"model": MODEL, "text_1": S1, "text_2": [S2, S3]})
    assert score.status == 200, score.body
    recorded = body_of("55_score")
    assert shape(score.json()) == shape(recorded)
    assert score.json()["usage"] == recorded["usage"]  # 12 + 12 + 9
    assert score.json()["id"].startswith("score-")
    for path, name in (("/rerank", "64_rerank"), ("/v1/rerank", "64_rerank"), ("/v2/rerank", "64_rerank")):  # fmt: skip
        reply = post(stub.url, path, {"model": MODEL, "query": S1, "documents": [S2, S4]})
        assert reply.status == 200, (path, reply.body)
        assert shape(reply.json()) == shape(body_of(name))
        assert reply.json()["usage"] == body_of(name)["usage"]
    v1 = post(stub.url, "/v1/score", {"queries": [S1, S2], "documents": [S2, S1]})
    assert v1.json()["usage"] == body_of("82_score_queries_documents")["usage"]


def test_score_budget_per_query_and_document(stub):
    stub.engine.calls.clear()
    body = {"text_1": S1, "text_2": [S2], "max_tokens_per_query": 3, "max_tokens_per_doc": 2}
    assert post(stub.url, "/score", body).status == 200
    lengths = sorted(len(call[1]) for call in stub.engine.calls)
    assert lengths == [4, 5]  # the budget, then [CLS] and [SEP]
    too_big = post(stub.url, "/score", {**body, "max_tokens_per_doc": MAX_MODEL_LEN})
    assert (
        "max_tokens_per_doc (256) must be less than max_model_len (256)."
        in (openai_error(too_big)["message"])
    )


def test_use_activation_false_reaches_the_engine(stub):
    stub.engine.calls.clear()
    reply = post(stub.url, "/v1/embeddings", {"input": S1, "use_activation": False, "priority": 3})
    assert reply.status == 200
    (call,) = stub.engine.calls
    assert call[2] == PoolingParams(task="embed", use_activation=False) and call[3] == 3
    assert np.linalg.norm(reply.json()["data"][0]["embedding"]) > 1.5


def test_bytes_formats(stub):
    reply = post(stub.url, "/v1/embeddings", {"input": [S1, S2], "encoding_format": "bytes", "request_id": "b"})  # fmt: skip
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "application/octet-stream"
    metadata = json.loads(reply.headers["metadata"])
    assert list(metadata) == ["id", "created", "model", "data", "usage"]
    assert metadata["id"] == "embd-b" and metadata["usage"] == {"prompt_tokens": 24, "total_tokens": 24}  # fmt: skip
    assert [(d["start"], d["end"], d["shape"]) for d in metadata["data"]] == [(0, 1536, [384]), (1536, 3072, [384])]  # fmt: skip
    assert len(reply.body) == 3072
    only = post(stub.url, "/pooling", {"input": S1, "encoding_format": "bytes_only", "embed_dtype": "float16"})  # fmt: skip
    assert "metadata" not in only.headers and len(only.body) == 384 * 2


def test_shed_requests_are_503s_and_free_their_places(minilm_tokenizer, server_loop):
    engine = StubEngine(minilm_tokenizer, max_num_queued_reqs=2)
    with stub_server(server_loop, engine) as url:
        shed = post(url, "/v1/embeddings", {"input": [S1, S2, S3]})
        assert shed.status == 503 and shed.headers["Retry-After"] == "1"
        assert post(url, "/score", {"text_1": S1, "text_2": [S2]}).status == 200
        assert engine.load_shedder.num_reserved == 0


def test_a_client_gone_aborts_every_prompt(minilm_tokenizer, server_loop):
    engine = StubEngine(minilm_tokenizer, hang=True)

    async def give_up(url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(url + "/v1/embeddings", json={"input": [S1, S2]})

    with stub_server(server_loop, engine) as url:
        asyncio.run(give_up(url))
        deadline = time.monotonic() + 10
        while len(engine.cancelled) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert sorted(engine.cancelled) == sorted(call[0] for call in engine.calls)
    assert len(engine.cancelled) == 2
