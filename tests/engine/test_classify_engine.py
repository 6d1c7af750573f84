"""A sequence classifier through the engine: a random-weight BERT cross-encoder (one label)
and a three-label classifier with MiniLM's shape and tokenizer (tests/cross_encoder_folders.py),
against transformers' AutoModelForSequenceClassification on the same folders."""

from __future__ import annotations

import pytest
import torch

from aioserve.engine.admission import InvalidRequest
from aioserve.engine.llm import LLM
from aioserve.engine.pooling_params import PoolingParams
from tests.cross_encoder_folders import build_classifier, build_cross_encoder, reference_scores

QUERY = "What does a fox eat?"
DOCUMENTS = ["Foxes eat rabbits, birds and berries.", "Paris is the capital of France.", "x"]


def test_a_cross_encoder_scores_pairs_as_transformers(minilm_folder, tmp_path):
    folder = str(build_cross_encoder(tmp_path, source=minilm_folder))
    with LLM(folder, dtype="float32") as llm:
        settings = llm.engine.settings
        assert settings.pooler.task == "classify" and settings.pooler.activation == "sigmoid"
        scores = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
        pair = llm.get_tokenizer()(QUERY, DOCUMENTS[0])
        as_pair = {"prompt_token_ids": pair.input_ids, "token_type_ids": pair.token_type_ids}
        unpaired = {"prompt_token_ids": pair.input_ids}
        raw, one_segment = llm.classify(
            [as_pair, unpaired], PoolingParams(use_activation=False), use_tqdm=False
        )
        with pytest.raises(InvalidRequest, match="pooling task is 'classify', not 'embed'"):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(InvalidRequest, match="token_type_ids has 2 entries for 3 prompt"):
            llm.classify({"prompt_token_ids": [101, 5, 102], "token_type_ids": [0, 1]})
        with pytest.raises(InvalidRequest, match="token_type_ids must be zeros then ones"):
            llm.classify({"prompt_token_ids": [101, 5, 102], "token_type_ids": [1, 0, 1]})
        with pytest.raises(
            ValueError, match="cannot overwrite params.task='embed' with 'classify'"
        ):
            llm.classify("hello", PoolingParams(task="embed"))
        # With no task named, the model's: encode's logits are classify's.
        (encoded,) = llm.encode(as_pair, PoolingParams(use_activation=False), use_tqdm=False)
    expected = [row[0] for row in reference_scores(folder, [(QUERY, d) for d in DOCUMENTS])]
    got = [s.outputs.score for s in scores]
    assert got == pytest.approx(expected, abs=1e-5)
    assert max(got) - min(got) > 0.01  # the pairs' texts count
    (logit,) = reference_scores(folder, [(QUERY, DOCUMENTS[0])], activate=False)[0]
    assert raw.data[0].item() == pytest.approx(logit, abs=1e-5)
    torch.testing.assert_close(encoded.data, raw.data, atol=1e-5, rtol=1e-5)
    assert abs(one_segment.data[0] - raw.data[0]) > 1e-4  # so do the token types


def test_a_three_label_classifier_gives_softmax_probabilities(minilm_folder, tmp_path):
    folder = str(build_classifier(tmp_path, source=minilm_folder))
    texts = ["I love it.", "It is a table.", "Terrible, never again."]
    with LLM(folder, dtype="float32") as llm:
        outputs = llm.classify(texts, use_tqdm=False)
        assert llm.engine.hf_config.id2label[2] == "positive"
        with pytest.raises(ValueError, match="Scoring API is only enabled for num_labels == 1"):
            llm.score(texts[0], texts[1:])
        assert llm.engine.settings.pooler.activation == "softmax"
    probs = torch.stack([o.data for o in outputs])
    torch.testing.assert_close(
        probs, torch.tensor(reference_scores(folder, texts)), atol=1e-5, rtol=1e-5
    )
    assert outputs[0].outputs.probs == pytest.approx(probs[0].tolist())
