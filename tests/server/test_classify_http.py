"""A sequence classifier's routes (/classify, /pooling, cross-encoder /score and /rerank)
against vLLM 0.32's answers, without a model.

References: vLLM 0.32's recorded answers serving the random-weight folders of
tests/cross_encoder_folders.py (vllm_samples/100-160: a one-label BERT cross-encoder as "ce",
a three-label classifier as "cls": shapes, ids, token counts, error texts), and the
MiniLM tokenizer those folders carry, whose pair encodings are what vLLM counted.

Two layers: the pair tokenization and the answers with plain values; the handlers
in-process on a stand-in engine (`StubClassifier`: the real tokenizer, a cheap score from
the token ids and types, the engine's own checks). The scores of a real model against
transformers are test_classify_served.py's.
"""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp import web

from aioserve.engine.load_shedding import LoadShedder
from aioserve.engine.outputs import PoolingRequestOutput
from aioserve.engine.pooling_params import PoolingParams, check_pooling_request, token_types_of
from aioserve.models.pooler import PoolerConfig
from aioserve.server.classify import classification_response, label_of
from aioserve.server.cross_encoding import encode_pair, encode_pairs, pair_score
from aioserve.server.errors import APIError, error_middleware
from aioserve.server.openapi import openapi_document
from aioserve.server.pooling_routes import add_pooling_routes
from aioserve.server.responses import ResponseHead
from aioserve.server.state import STATE, ServerState
from tests.server.conftest import serve_app
from tests.server.openai_helpers import post, sample, shape
from tests.server.serve_process import fetch, openai_error

CE, CLS = "ce", "cls"
"""The names vLLM served the cross-encoder and the classifier under in the samples."""
MAX_MODEL_LEN = 512
"""vLLM's context for these folders: no sentence-transformers files, so the config's 512
position embeddings (vllm_samples/100)."""
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
S1 = "The quick brown fox jumps over the lazy dog."
S2 = "A fast auburn fox leapt over a sleepy hound."
S3 = "Paris is the capital of France."
S4 = "Foxes are animals."
LONG = "hello " * 600


def body_of(name: str) -> Any:
    return sample(name)["response"]["body"]


def request_of(name: str) -> dict[str, Any]:
    return sample(name)["request"]["body"]


@pytest.fixture(scope="module")
def tokenizer(minilm_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_folder)


# --- pairs and answers, with plain values ----------------------------------------------------


def test_a_pair_is_the_tokenizers_pair_encoding_with_its_token_types(tokenizer):
    prompt = encode_pair(tokenizer, S1, S2)
    expected = tokenizer(S1, S2)
    assert prompt.token_ids == expected["input_ids"] and len(prompt.token_ids) == 23  # sample 103
    assert prompt.token_type_ids == expected["token_type_ids"]
    assert prompt.token_type_ids == [0] * 12 + [1] * 11  # [CLS] S1 [SEP] | S2 [SEP]
    empty = encode_pair(tokenizer, "", "")
    assert (empty.token_ids, empty.token_type_ids) == ([101, 102], [0, 0])  # sample 136: 2 tokens
    whole = encode_pair(tokenizer, S1, LONG)
    assert len(whole.token_ids) == 12 + 600 + 1  # not cut: refused with its real length


def test_pairs_are_cut_as_vllm_cuts_them(tokenizer):
    """The token counts vLLM reported for the same requests."""
    cut = encode_pairs(tokenizer, [S1], [S2, LONG], max_length=20)  # sample 113: 20 + 20
    assert [len(p.token_ids) for p in cut] == [20, 20]
    assert cut[1].token_type_ids == [0] * 10 + [1] * 10  # longest_first: from the longer text
    per_doc = encode_pairs(tokenizer, [S1], [LONG, S2], max_doc_tokens=5)  # sample 114: 36
    assert [len(p.token_ids) for p in per_doc] == [18, 18]
    assert tokenizer.decode(per_doc[1].token_ids[12:-1]) == "a fast auburn fox leapt"
    per_query = encode_pairs(tokenizer, [S1], [S2, S4], max_query_tokens=3)  # sample 116: 26
    assert [len(p.token_ids) for p in per_query] == [16, 10]
    pairwise = encode_pairs(tokenizer, [S1, S2], [S2, S1])  # sample 102: 46
    assert [p.token_ids for p in pairwise] == [tokenizer(S1, S2).input_ids, tokenizer(S2, S1).input_ids]  # fmt: skip
    assert sum(len(p.token_ids) for p in pairwise) == body_of("102_score_cross_encoder_pairs")["usage"]["prompt_tokens"]  # fmt: skip
    with pytest.raises(APIError) as caught:  # the tokenizer cannot cut only the document
        encode_pair(tokenizer, LONG, S2, max_length=10, max_doc_tokens=2)
    recorded = body_of("164_err_score_only_second_too_short")["error"]
    assert (caught.value.status, caught.value.message) == (recorded["code"], recorded["message"])


def test_a_pairs_score_is_its_one_output():
    output = PoolingRequestOutput("r", [101, 102], torch.tensor([0.25]))
    assert pair_score(output) == 0.25
    with pytest.raises(APIError) as caught:
        pair_score(PoolingRequestOutput("r", [101, 102], torch.tensor([0.2, 0.8])))
    assert caught.value.status == 500


def test_classify_answers_have_vllm_keys_labels_and_counts():
    head = ResponseHead("classify-x", "list", CLS, 1)
    outputs = [
        PoolingRequestOutput("a", list(range(12)), torch.tensor([0.1, 0.8, 0.1])),
        PoolingRequestOutput("b", list(range(12)), torch.tensor([0.2, 0.2, 0.6])),
    ]
    answer = classification_response(head, outputs, LABELS)
    assert shape(answer) == shape(body_of("151_classify_three_labels"))
    assert [d["label"] for d in answer["data"]] == ["neutral", "positive"]
    assert [d["num_classes"] for d in answer["data"]] == [3, 3]
    assert answer["data"][1]["probs"] == pytest.approx([0.2, 0.2, 0.6])
    assert answer["usage"] == {**body_of("107_classify_two")["usage"]}  # 12 + 12
    one = classification_response(head, outputs[:1], {0: "LABEL_0"})
    assert one["data"][0]["label"] is None  # vLLM: id2label.get(argmax) (1 has no label)
    ties = classification_response(head, [PoolingRequestOutput("c", [1], torch.tensor([0.5, 0.5]))], LABELS)  # fmt: skip
    assert ties["data"][0]["label"] == "negative"  # argmax: the first of equal scores


def test_labels_read_int_or_string_keys():
    assert label_of(LABELS, 2) == "positive"
    assert label_of({"0": "LABEL_0"}, 0) == "LABEL_0"
    assert label_of(None, 0) is None and label_of({}, 0) is None


def test_only_an_embedding_model_or_a_one_label_classifier_scores_pairs():
    def classifier(num_labels):
        return PoolerConfig("CLS", True, task="classify", num_labels=num_labels)

    assert classifier(1).scores_pairs and not classifier(3).scores_pairs
    assert PoolerConfig("MEAN", True).scores_pairs


# --- the handlers on a stand-in engine ------------------------------------------------------


@dataclass
class _StubScheduler:
    num_waiting: int = 0
    num_running: int = 0
    num_prefill_tokens: int = 0


@dataclass
class StubClassifier:
    """What the pooling handlers use of an AsyncEngine serving a BERT classifier: logits
    from the token ids and types (the second segment counts), activated as vLLM's (sigmoid
    for one label, softmax for more) unless use_activation is false."""

    tokenizer: Any
    num_labels: int = 1
    calls: list[tuple[str, list[int], list[int] | None, PoolingParams, int]] = field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        self.settings = SimpleNamespace(
            max_model_len=MAX_MODEL_LEN,
            served_model_names=[self.name],
            model_name=self.name,
            pooled_size=384,
            matryoshka_dimensions=None,
            runner_type="pooling",
            pooler=PoolerConfig("CLS", True, task="classify", num_labels=self.num_labels),
        )
        self.hf_config = SimpleNamespace(
            vocab_size=30522,
            type_vocab_size=2,
            architectures=["BertForSequenceClassification"],
            num_labels=self.num_labels,
            id2label=LABELS if self.num_labels == 3 else {0: "LABEL_0"},
        )
        self.load_shedder = LoadShedder(_StubScheduler(), None, None)

    @property
    def name(self) -> str:
        return CE if self.num_labels == 1 else CLS

    def logits(self, token_ids: list[int], types: list[int] | None) -> torch.Tensor:
        second = sum(types or [])
        return torch.tensor(
            [
                ((sum(token_ids) * (k + 1) + 7 * second) % 101) / 25.0 - 2.0
                for k in range(self.num_labels)
            ]  # fmt: skip
        )

    async def encode(self, prompt, params, request_id, *, priority=0) -> PoolingRequestOutput:
        self.load_shedder.check(1)
        token_ids = prompt["prompt_token_ids"]
        check_pooling_request(self.settings, self.hf_config.vocab_size, token_ids, params)
        types = token_types_of(prompt, len(token_ids), self.hf_config.type_vocab_size)
        self.calls.append((request_id, token_ids, types, params, priority))
        await asyncio.sleep(0)
        logits = self.logits(token_ids, types)
        if params.use_activation is not False:
            logits = torch.sigmoid(logits) if self.num_labels == 1 else logits.softmax(-1)
        return PoolingRequestOutput(request_id, list(token_ids), logits)


@contextmanager
def stub_server(server_loop, engine):
    app = web.Application(middlewares=[error_middleware])
    app[STATE] = ServerState(engine, [engine.name])
    add_pooling_routes(app)
    with serve_app(server_loop, app) as url:
        yield SimpleNamespace(url=url, engine=engine, app=app)


@pytest.fixture(scope="module")
def ce(tokenizer, server_loop):
    with stub_server(server_loop, StubClassifier(tokenizer, 1)) as served:
        yield served


@pytest.fixture(scope="module")
def cls(tokenizer, server_loop):
    with stub_server(server_loop, StubClassifier(tokenizer, 3)) as served:
        yield served


def test_routes_are_vllms_for_each_kind_of_classifier(ce, cls):
    """vLLM registers /classify and /pooling for a classifier, the scoring routes for one
    label only, /v1/embeddings for none (samples 111, 153-156, 160: 404)."""
    for path, body in (
        ("/classify", {"input": S1}),
        ("/pooling", {"input": S1}),
        ("/score", {"text_1": S1, "text_2": S2}),
        ("/v1/score", {"text_1": S1, "text_2": S2}),
        ("/rerank", {"query": S1, "documents": [S2]}),
        ("/v1/rerank", {"query": S1, "documents": [S2]}),
        ("/v2/rerank", {"query": S1, "documents": [S2]}),
    ):
        assert post(ce.url, path, body).status == 200, path
        expected = 200 if path in ("/classify", "/pooling") else 404
        assert post(cls.url, path, body).status == expected, path
    for served in (ce, cls):
        assert post(served.url, "/v1/embeddings", {"input": S1}).status == 404
    paths = openapi_document(ce.app, None)["paths"]
    assert "/classify" in paths and "/rerank" in paths and "/v1/embeddings" not in paths


@pytest.mark.parametrize(
    "name",
    [
        "101_score_cross_encoder",
        "102_score_cross_encoder_pairs",
        "103_score_cross_encoder_str_str",
        "113_score_truncate_prompt_tokens",
        "114_score_max_tokens_per_doc",
        "115_score_use_activation_false",
        "117_score_truncate_left",
        "129_score_data_1_data_2",
        "136_score_empty_strings",
        "139_score_truncate_minus_one",
    ],
)
def test_scores_count_each_pair_as_vllm(ce, name):
    recorded = sample(name)
    reply = post(ce.url, recorded["request"]["path"], recorded["request"]["body"])
    assert reply.status == 200, reply.body
    expected = recorded["response"]["body"]
    assert shape(reply.json()) == shape(expected)
    assert reply.json()["usage"] == expected["usage"]
    assert len(reply.json()["data"]) == len(expected["data"])


@pytest.mark.parametrize(
    "name",
    [
        "104_rerank_cross_encoder",
        "105_rerank_v2_cross_encoder",
        "116_rerank_max_tokens_per_query",
        "132_rerank_documents_string",
    ],
)
def test_reranks_count_each_pair_as_vllm(ce, name):
    recorded = sample(name)
    reply = post(ce.url, recorded["request"]["path"], recorded["request"]["body"])
    assert reply.status == 200, reply.body
    expected = recorded["response"]["body"]
    body = reply.json()
    assert shape(body) == shape(expected) and body["usage"] == expected["usage"]
    assert len(body["results"]) == len(expected["results"])
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


def test_each_pair_is_one_engine_request_with_its_token_types(ce, tokenizer):
    ce.engine.calls.clear()
    reply = post(ce.url, "/score", {"text_1": S1, "text_2": [S2, S3], "request_id": "s1", "priority": 2})  # fmt: skip
    assert reply.json()["id"] == "score-s1"
    calls = sorted(ce.engine.calls)
    assert [c[0] for c in calls] == ["score-s1-0", "score-s1-1"]
    for call, document in zip(calls, (S2, S3), strict=True):
        expected = tokenizer(S1, document)
        assert call[1] == expected.input_ids and call[2] == expected.token_type_ids
        assert call[3] == PoolingParams(task="classify") and call[4] == 2
    scores = [d["score"] for d in reply.json()["data"]]
    stub = ce.engine
    assert scores == pytest.approx([torch.sigmoid(stub.logits(c[1], c[2])).item() for c in calls])


def test_a_side_slices_the_pairs_tokens_and_types_alike(ce, tokenizer):
    """Sample 117: truncate_prompt_tokens 10 from the left keeps the document's last 10
    tokens, each of type 1."""
    ce.engine.calls.clear()
    post(ce.url, "/score", request_of("117_score_truncate_left"))
    ((_, token_ids, types, _, _),) = ce.engine.calls
    expected = tokenizer(S1, S2)
    assert token_ids == expected.input_ids[-10:] and types == [1] * 10


def test_use_activation_false_gives_the_raw_logit(ce):
    ce.engine.calls.clear()
    raw = post(ce.url, "/rerank", {"query": S1, "documents": [S2], "use_activation": False})
    (call,) = ce.engine.calls
    assert call[3] == PoolingParams(task="classify", use_activation=False)
    expected = ce.engine.logits(call[1], call[2]).item()
    assert raw.json()["results"][0]["relevance_score"] == pytest.approx(expected)


def test_classify_counts_ids_and_activation_as_vllm(ce, cls):
    for name in ("106_classify_one", "107_classify_two", "108_classify_token_ids", "124_classify_truncate", "126_classify_request_id", "128_classify_dimensions_ignored", "135_classify_empty_string"):  # fmt: skip
        recorded = sample(name)
        reply = post(ce.url, "/classify", recorded["request"]["body"])
        assert reply.status == 200, (name, reply.body)
        expected = recorded["response"]["body"]
        assert shape(reply.json()) == shape(expected), name
        assert reply.json()["usage"] == expected["usage"], name
        assert [d["label"] for d in reply.json()["data"]] == [d["label"] for d in expected["data"]]
    assert post(ce.url, "/classify", request_of("126_classify_request_id")).json()["id"] == "classify-my-id-1"  # fmt: skip
    header = fetch("POST", ce.url + "/classify", body={"input": S1}, headers={"X-Request-Id": "h7"})
    assert header.json()["id"] == "classify-h7"
    cls.engine.calls.clear()
    three = post(cls.url, "/classify", {"model": CLS, "input": [S1, S2], "use_activation": False})
    assert [c[3] for c in cls.engine.calls] == [PoolingParams(task="classify", use_activation=False)] * 2  # fmt: skip
    item = three.json()["data"][0]
    assert item["num_classes"] == 3 and item["label"] == LABELS[int(np.argmax(item["probs"]))]
    activated = post(cls.url, "/classify", {"input": S1}).json()["data"][0]["probs"]
    assert sum(activated) == pytest.approx(1.0)  # softmax (sample 151)
    assert activated == pytest.approx(torch.tensor(item["probs"]).softmax(-1).tolist())


def test_pooling_on_a_classifier_answers_its_scores(cls):
    cls.engine.calls.clear()
    pooled = post(cls.url, "/pooling", {"input": [S1, S2]})
    assert pooled.status == 200
    assert shape(pooled.json()) == shape(body_of("155_pooling_classifier"))
    assert pooled.json()["usage"] == body_of("155_pooling_classifier")["usage"]
    assert [c[3].task for c in cls.engine.calls] == ["classify", "classify"]
    assert sum(pooled.json()["data"][0]["data"]) == pytest.approx(1.0)
    encoded = post(cls.url, "/pooling", {"input": S1, "encoding_format": "base64"}).json()
    assert len(base64.b64decode(encoded["data"][0]["data"])) == 3 * 4  # sample 157
    assert post(cls.url, "/pooling", {"input": S1, "task": "classify"}).status == 200


@pytest.mark.parametrize(
    ("route", "name"),
    [
        ("/score", "112_err_score_too_long"),
        ("/score", "125_err_score_empty_documents"),
        ("/score", "131_err_score_lengths"),
        ("/score", "137_err_score_max_tokens_per_doc_big"),
        ("/score", "138_err_score_truncate_too_big"),
        ("/classify", "122_err_classify_empty_list"),
        ("/classify", "123_err_classify_too_long"),
        ("/classify", "134_err_classify_normalize"),
        ("/classify", "140_err_classify_token_out_of_vocab"),
        ("/pooling", "142_err_pooling_dimensions_classifier"),
    ],
)
def test_refusals_read_as_vllm_words_them(ce, route, name):
    """Status and message as vLLM's, "at least 513" included for a text (or pair) tokenized
    no further than one token past the context; aioserve adds "(parameter=..., value=...)"
    where a field is at fault."""
    recorded = sample(name)
    assert recorded["request"]["path"] == route
    reply = post(ce.url, route, recorded["request"]["body"])
    error = recorded["response"]["body"]["error"]
    assert reply.status == error["code"] == 400, reply.body
    expected = error["message"].split(" (parameter=")[0]
    assert openai_error(reply)["message"].startswith(expected), (reply.body, expected)


def test_other_refusals(ce, cls):
    chat = post(ce.url, "/classify", request_of("118_err_classify_messages"))
    assert chat.status == 400 and "chat template" in openai_error(chat)["message"]  # sample 118
    task = post(cls.url, "/pooling", {"input": S1, "task": "embed"})
    # vLLM lists its two tasks (sample 119: "['token_classify', 'classify']", in either
    # order); aioserve serves the model's one.
    assert openai_error(task)["message"] == (
        "Unsupported task: 'embed' Supported tasks: ['classify'] (parameter=task)"
    )
    unknown = post(ce.url, "/classify", request_of("133_err_classify_unknown_model"))
    assert unknown.status == 404  # sample 133
    assert openai_error(unknown)["message"].startswith("The model `nope` does not exist.")
    assert post(ce.url, "/classify", {"input": 5}).status == 400  # sample 130
    assert post(ce.url, "/score", {"text_1": [101, 7592, 102], "text_2": S2}).status == 400
    mm = post(ce.url, "/rerank", {"query": S1, "documents": [{"content": []}]})
    assert openai_error(mm)["message"] == (
        "MultiModalParam is not supported for BertForSequenceClassification"
    )


def test_recorded_samples_are_consistent():
    """The recorded pair is the same pair however it is asked for (samples 101, 103, 127,
    104 and 105 score S1 against S2 alike), and the scoring answers' ids are "score-"."""
    score = body_of("101_score_cross_encoder")["data"][0]["score"]
    assert body_of("103_score_cross_encoder_str_str")["data"][0]["score"] == score
    assert body_of("127_score_request_id_header")["id"] == "score-hdr-7"
    reranked = {r["index"]: r["relevance_score"] for r in body_of("105_rerank_v2_cross_encoder")["results"]}  # fmt: skip
    assert reranked[0] == pytest.approx(score, abs=1e-6)
    metadata = json.dumps(body_of("100_models_cross_encoder"))
    assert '"max_model_len": 512' in metadata
