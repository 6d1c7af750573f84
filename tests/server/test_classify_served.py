"""Classifiers and cross-encoders served for real: `python -m aioserve serve` on the
random-weight folders of tests/cross_encoder_folders.py, against transformers and vLLM 0.32.

References: transformers' AutoModelForSequenceClassification on the same folder, the pair
tokenized as `tokenizer(query, document)` (token types 1 for the document), its logits
through the activation vLLM applies (`reference_scores`); and vLLM's answers serving the
same folders (vllm_samples/100-160), which the first test ties to transformers: the
folders are rebuilt here from the same seeds, so vLLM's recorded numbers are this
folder's. The request reading, the answers' shapes and the refusals are tested without a
model in test_classify_http.py.

The served tests need the engine's sequence-classification models (skipped when
aioserve.models.registry has no BertForSequenceClassification).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cross_encoder_folders import (
    build_classifier,
    build_cross_encoder,
    build_roberta_cross_encoder,
    reference_scores,
)
from tests.server.openai_helpers import SAMPLES, post, sample, shape
from tests.server.serve_process import (
    fetch,
    read_metrics,
    serve_model,
)

CE, CLS, ROBERTA = "ce", "cls", "roberta-ce"
S1 = "The quick brown fox jumps over the lazy dog."
S2 = "A fast auburn fox leapt over a sleepy hound."
S3 = "Paris is the capital of France."
S4 = "Foxes are animals."
LONG = "hello " * 600
TOLERANCE = 1e-4
"""Float32 on both sides: vLLM's recorded scores and transformers' agree to 2e-7."""


def _has_classifiers() -> bool:
    from aioserve.models.registry import MODEL_CLASSES

    return "BertForSequenceClassification" in MODEL_CLASSES


needs_classifiers = pytest.mark.skipif(
    not _has_classifiers(), reason="the engine has no sequence-classification models yet"
)


def body_of(name: str) -> Any:
    return sample(name)["response"]["body"]


@pytest.fixture(scope="module")
def folders(minilm_folder, tmp_path_factory) -> dict[str, Path]:
    """The folders vLLM served for the samples: "ce" (one label, Sigmoid named as
    sentence-transformers names it), "cls" (three labels) and "roberta-ce" (RoBERTa's
    head, no token types)."""
    root = tmp_path_factory.mktemp("classifiers")
    return {
        CE: build_cross_encoder(root / "ce", source=minilm_folder),
        CLS: build_classifier(root / "cls", source=minilm_folder),
        ROBERTA: build_roberta_cross_encoder(root / "roberta", source=minilm_folder),
    }


def test_vllms_recorded_scores_are_transformers(folders):
    """vLLM 0.32 scores a pair as transformers does with the pair's token types, through a
    sigmoid for one label and a softmax for three (samples 101, 106, 109, 151, 152)."""
    pairs = [(S1, S2), (S1, S3)]
    recorded = [d["score"] for d in body_of("101_score_cross_encoder")["data"]]
    got = [row[0] for row in reference_scores(folders[CE], pairs)]
    assert got == pytest.approx(recorded, abs=1e-6)
    single = reference_scores(folders[CE], [S1])[0]
    assert single == pytest.approx(body_of("106_classify_one")["data"][0]["probs"], abs=1e-6)
    raw = reference_scores(folders[CE], [S1], activate=False)[0]
    expected = body_of("109_classify_use_activation_false")["data"][0]["probs"]
    assert raw == pytest.approx(expected, abs=1e-5)
    three = reference_scores(folders[CLS], [S1, S2, "I love it"])
    for row, item in zip(three, body_of("151_classify_three_labels")["data"], strict=True):
        assert row == pytest.approx(item["probs"], abs=1e-6)
    logits = reference_scores(folders[CLS], [S1], activate=False)[0]
    expected = body_of("152_classify_three_labels_raw")["data"][0]["probs"]
    assert logits == pytest.approx(expected, abs=1e-5)
    roberta = [row[0] for row in reference_scores(folders[ROBERTA], [(S1, S2), (S1, S4)])]
    results = body_of("162_rerank_roberta_cross_encoder")["results"]
    assert roberta == pytest.approx([r["relevance_score"] for r in results], abs=1e-6)


def _serve(folder: Path, name: str, log: Path):
    with serve_model(folder, name, log, "--dtype", "float32", "--enforce-eager") as url:
        yield url


@pytest.fixture(scope="module")
def ce_server(folders, tmp_path_factory):
    if not _has_classifiers():
        pytest.skip("the engine has no sequence-classification models yet")
    yield from _serve(folders[CE], CE, tmp_path_factory.mktemp("serve-ce") / "serve.log")


@pytest.fixture(scope="module")
def cls_server(folders, tmp_path_factory):
    if not _has_classifiers():
        pytest.skip("the engine has no sequence-classification models yet")
    yield from _serve(folders[CLS], CLS, tmp_path_factory.mktemp("serve-cls") / "serve.log")


@pytest.fixture(scope="module")
def roberta_server(folders, tmp_path_factory):
    from aioserve.models.registry import MODEL_CLASSES

    if "RobertaForSequenceClassification" not in MODEL_CLASSES:
        pytest.skip("the engine has no RobertaForSequenceClassification yet")
    log = tmp_path_factory.mktemp("serve-roberta") / "serve.log"
    yield from _serve(folders[ROBERTA], ROBERTA, log)


def _replayed(url: str, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Our answer to the recorded request, and vLLM's."""
    recorded = sample(name)
    reply = post(url, recorded["request"]["path"], recorded["request"]["body"])
    assert reply.status == recorded["response"]["status"] == 200, reply.body
    return reply.json(), recorded["response"]["body"]


@needs_classifiers
def test_models_report_vllms_context(ce_server):
    models = fetch("GET", ce_server + "/v1/models").json()
    assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(CE, 512)]


@needs_classifiers
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
def test_scores_are_vllms(ce_server, name):
    got, expected = _replayed(ce_server, name)
    assert shape(got) == shape(expected) and got["usage"] == expected["usage"]
    scores = [d["score"] for d in got["data"]]
    assert scores == pytest.approx([d["score"] for d in expected["data"]], abs=TOLERANCE)


@needs_classifiers
@pytest.mark.parametrize(
    "name",
    [
        "104_rerank_cross_encoder",
        "105_rerank_v2_cross_encoder",
        "116_rerank_max_tokens_per_query",
        "132_rerank_documents_string",
    ],
)
def test_reranks_are_vllms(ce_server, name):
    got, expected = _replayed(ce_server, name)
    assert shape(got) == shape(expected) and got["usage"] == expected["usage"]
    assert [r["index"] for r in got["results"]] == [r["index"] for r in expected["results"]]
    assert [r["relevance_score"] for r in got["results"]] == pytest.approx(
        [r["relevance_score"] for r in expected["results"]], abs=TOLERANCE
    )


@needs_classifiers
def test_scores_are_transformers_pair_scores(ce_server, folders):
    documents = [S2, S3, S4, ""]
    reply = post(ce_server, "/score", {"queries": S4, "documents": documents}).json()
    expected = [row[0] for row in reference_scores(folders[CE], [(S4, d) for d in documents])]
    assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=TOLERANCE)


@needs_classifiers
@pytest.mark.parametrize(
    "name",
    [
        "106_classify_one",
        "107_classify_two",
        "108_classify_token_ids",
        "109_classify_use_activation_false",
        "110_pooling_cross_encoder",
        "121_pooling_task_classify_no_activation",
        "124_classify_truncate",
        "135_classify_empty_string",
    ],
)
def test_a_cross_encoder_classifies_as_vllm(ce_server, name):
    got, expected = _replayed(ce_server, name)
    assert shape(got) == shape(expected) and got["usage"] == expected["usage"]
    key = "probs" if "label" in expected["data"][0] else "data"
    for ours, theirs in zip(got["data"], expected["data"], strict=True):
        assert ours[key] == pytest.approx(theirs[key], abs=TOLERANCE)


@needs_classifiers
@pytest.mark.parametrize(
    "name",
    [
        "151_classify_three_labels",
        "152_classify_three_labels_raw",
        "155_pooling_classifier",
        "158_classify_token_id_lists",
        "159_classify_truncate_left",
    ],
)
def test_a_classifier_classifies_as_vllm(cls_server, name):
    got, expected = _replayed(cls_server, name)
    assert shape(got) == shape(expected) and got["usage"] == expected["usage"]
    for ours, theirs in zip(got["data"], expected["data"], strict=True):
        if "label" in theirs:
            assert ours["label"] == theirs["label"]
            assert ours["probs"] == pytest.approx(theirs["probs"], abs=TOLERANCE)
        else:
            assert ours["data"] == pytest.approx(theirs["data"], abs=TOLERANCE)


@needs_classifiers
def test_routes_a_classifier_has(ce_server, cls_server):
    """As vLLM (samples 111, 145, 153, 154, 156): no embeddings or generation routes, and
    no scoring routes for a classifier of more than one label."""
    assert post(ce_server, "/v1/embeddings", {"input": S1}).status == 404
    assert post(ce_server, "/v1/completions", {"prompt": "Hi"}).status == 404
    assert post(cls_server, "/score", {"text_1": S1, "text_2": S2}).status == 404
    assert post(cls_server, "/rerank", {"query": S1, "documents": [S2]}).status == 404
    assert post(cls_server, "/v1/embeddings", {"input": S1}).status == 404


def _recorded_metrics(name: str) -> dict[tuple[str, tuple], float]:
    text = (SAMPLES / f"{name}.txt").read_text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@needs_classifiers
def test_metrics_count_each_pair_as_a_finished_request(ce_server):
    """vLLM counted the rerank of 3 documents (sample 148) as 3 finished requests of 60
    prompt tokens in all (samples 147 -> 149)."""
    before_vllm = _recorded_metrics("147_metrics_after_score")
    after_vllm = _recorded_metrics("149_metrics_after_rerank")

    def vllm_moved(name: str) -> float:
        return sum(v for (n, _), v in after_vllm.items() if n == name) - sum(
            v for (n, _), v in before_vllm.items() if n == name
        )

    def value(samples, name):
        return sum(s.value for s in samples if s.name == name)

    before = read_metrics(ce_server)
    request = sample("148_rerank_for_metrics")["request"]["body"]
    assert post(ce_server, "/rerank", request).status == 200
    after = read_metrics(ce_server)
    for name in ("vllm:request_success_total", "vllm:prompt_tokens_total"):
        assert value(after, name) - value(before, name) == vllm_moved(name), name
    assert vllm_moved("vllm:request_success_total") == 3
    assert vllm_moved("vllm:prompt_tokens_total") == 60


@pytest.mark.parametrize(
    "name", ["162_rerank_roberta_cross_encoder", "163_classify_roberta_cross_encoder"]
)
def test_a_roberta_cross_encoder_scores_as_vllm(roberta_server, name):
    """RoBERTa's head and one segment: no token types sent (vLLM's answers, 161-163)."""
    got, expected = _replayed(roberta_server, name)
    assert shape(got) == shape(expected) and got["usage"] == expected["usage"]
    key = "results" if "results" in expected else "data"
    for ours, theirs in zip(got[key], expected[key], strict=True):
        for field in ("relevance_score", "probs"):
            if field in theirs:
                assert ours[field] == pytest.approx(theirs[field], abs=TOLERANCE)
