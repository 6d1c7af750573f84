"""A sequence classifier through the engine: a random-weight cross-encoder (one label) and a
three-label classifier on BERT with MiniLM's tokenizer, against transformers'
AutoModelForSequenceClassification on the same folder."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.llm import LLM
from aioserve.engine.pooling_params import PoolingParams

QUERY = "What does a fox eat?"
DOCUMENTS = ["Foxes eat rabbits, birds and berries.", "Paris is the capital of France.", "x"]


def classifier_folder(folder, minilm_folder, num_labels: int, **settings):
    """A tiny random BertForSequenceClassification with MiniLM's tokenizer, saved."""
    tokenizer = AutoTokenizer.from_pretrained(minilm_folder)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,  # random outputs that differ from text to text
        num_labels=num_labels,
        architectures=["BertForSequenceClassification"],
        **settings,
    )
    torch.manual_seed(num_labels)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def cross_encoder(minilm_folder, tmp_path_factory):
    return classifier_folder(tmp_path_factory.mktemp("cross-encoder"), minilm_folder, 1)


def reference_logits(folder: str, pairs: list[tuple[str, str]] | list[str]) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    rows = []
    for pair in pairs:
        batch = (
            tokenizer(*pair, return_tensors="pt")
            if isinstance(pair, tuple)
            else tokenizer(pair, return_tensors="pt")
        )
        with torch.no_grad():
            rows.append(model(**batch).logits[0])
    return torch.stack(rows)


def test_a_cross_encoder_scores_pairs_as_transformers(cross_encoder):
    with LLM(cross_encoder, dtype="float32") as llm:
        settings = llm.engine.settings
        assert settings.pooler.task == "classify" and settings.pooler.activation == "sigmoid"
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pair = llm.get_tokenizer()(QUERY, DOCUMENTS[0])
        as_pair = {"prompt_token_ids": pair.input_ids, "token_type_ids": pair.token_type_ids}
        unpaired = {"prompt_token_ids": pair.input_ids}
        raw, one_segment = llm.classify(
            [as_pair, unpaired], PoolingParams(use_activation=False), use_tqdm=False
        )
        with pytest.raises(
            InvalidRequest, match="this model's pooling task is 'classify', not 'embed'"
        ):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(
            InvalidRequest, match="token_type_ids has 2 entries for 3 prompt tokens"
        ):
            llm.classify(
                {"prompt_token_ids": [101, 5, 102], "token_type_ids": [0, 1]}, use_tqdm=False
            )
    logits = reference_logits(cross_encoder, [(QUERY, d) for d in DOCUMENTS])
    expected = torch.sigmoid(logits[:, 0])
    got = torch.tensor([s.outputs.score for s in scores])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert got.max() - got.min() > 0.05  # the pairs differ: the token types and texts count
    torch.testing.assert_close(raw.data, logits[0], atol=1e-5, rtol=1e-5)
    assert abs(one_segment.data[0] - raw.data[0]) > 1e-3  # the second text's token types count


def test_a_three_label_classifier_gives_softmax_probabilities(minilm_folder, tmp_path):
    folder = classifier_folder(
        tmp_path, minilm_folder, 3, id2label={0: "negative", 1: "neutral", 2: "positive"}
    )
    texts = ["I love it.", "It is a table.", "Terrible, never again."]
    with LLM(folder, dtype="float32") as llm:
        outputs = llm.classify(texts, use_tqdm=False)
        assert llm.engine.hf_config.id2label[2] == "positive"
    probs = torch.stack([o.data for o in outputs])
    torch.testing.assert_close(
        probs, torch.softmax(reference_logits(folder, texts), -1), atol=1e-5, rtol=1e-5
    )
    assert outputs[0].outputs.probs == pytest.approx(probs[0].tolist())
