"""Sequence classifiers on BERT and RoBERTa encoders against transformers' own
*ForSequenceClassification on the same random weights: the logits of packed prompts (BERT
pairs with their token types), and the activation vLLM picks for each config."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from aioserve.models.classifier_activation import activate, classifier_activation
from aioserve.models.pooler import PoolerConfig, pool, pooler_config_for
from aioserve.models.registry import model_class_for
from tests.models.test_bert import packed
from tests.models.tiny_models import tiny_bert_config, tiny_roberta_config


def classifier_config(architecture: str, num_labels: int):
    """A tiny random encoder's config (BERT's, or RoBERTa's / XLM-R's) as a classifier."""
    if "Roberta" in architecture:
        config = tiny_roberta_config(architecture.replace("ForSequenceClassification", "Model"))
    else:
        config = tiny_bert_config()
    config.architectures = [architecture]
    config.num_labels = num_labels
    return config


def hf_and_ours(config):
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    hf = AutoModelForSequenceClassification.from_config(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "bias" in name:
                param.normal_(0, 0.1)
    ours = model_class_for(config)(config)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


@pytest.mark.parametrize(
    ("architecture", "num_labels"),
    [
        ("BertForSequenceClassification", 1),
        ("BertForSequenceClassification", 3),
        ("RobertaForSequenceClassification", 1),
        ("XLMRobertaForSequenceClassification", 2),
    ],
)
def test_logits_match_transformers(architecture, num_labels):
    hf, ours = hf_and_ours(classifier_config(architecture, num_labels))
    pairs = [([0, 5, 6, 2], [2, 9, 9, 2]), ([0, 17, 2], [40, 41, 42, 43, 2])]
    token_lists = [a + b for a, b in pairs]
    types = [[0] * len(a) + [1] * len(b) for a, b in pairs]
    bert = architecture.startswith("Bert")
    input_ids, positions, cu_seqlens, max_seqlen = packed(token_lists)
    flat_types = torch.tensor([t for row in types for t in row]) if bert else None
    with torch.inference_mode():
        hidden = ours(input_ids, positions, cu_seqlens, max_seqlen, flat_types)
        logits = ours.classify(pool(hidden, cu_seqlens, "CLS"))
        expected = torch.cat(
            [
                hf(
                    input_ids=torch.tensor([tokens]),
                    token_type_ids=torch.tensor([row]) if bert else None,
                ).logits
                for tokens, row in zip(token_lists, types, strict=True)
            ]
        )
    assert logits.dtype == torch.float32 and logits.shape == (2, num_labels)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_the_token_types_change_a_bert_pairs_logits():
    _, ours = hf_and_ours(classifier_config("BertForSequenceClassification", 1))
    input_ids, positions, cu_seqlens, max_seqlen = packed([[0, 5, 6, 2, 9, 9, 2]])
    with torch.inference_mode():
        plain = ours.classify(
            pool(ours(input_ids, positions, cu_seqlens, max_seqlen), cu_seqlens, "CLS")
        )
        paired = ours.classify(
            pool(
                ours(
                    input_ids,
                    positions,
                    cu_seqlens,
                    max_seqlen,
                    torch.tensor([0, 0, 0, 0, 1, 1, 1]),
                ),
                cu_seqlens,
                "CLS",
            )
        )
    assert not torch.allclose(plain, paired)


@pytest.mark.parametrize(
    ("settings", "num_labels", "activation"),
    [
        ({}, 1, "sigmoid"),
        ({}, 3, "softmax"),
        ({"problem_type": "regression"}, 1, "identity"),
        ({"problem_type": "multi_label_classification"}, 3, "sigmoid"),
        ({"problem_type": "single_label_classification"}, 1, "sigmoid"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, 1, "identity"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, 1, "sigmoid"),
        # vLLM reads Sigmoid as its classify activation: softmax for several labels.
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, 3, "softmax"),
    ],
)  # fmt: skip
def test_the_activation_is_vllms_for_the_config(settings, num_labels, activation):
    config = classifier_config("BertForSequenceClassification", num_labels)
    for key, value in settings.items():
        setattr(config, key, value)
    assert classifier_activation(config) == activation
    assert pooler_config_for(None, config, {}) == PoolerConfig(
        "CLS", True, task="classify", num_labels=num_labels, activation=activation
    )


def test_activations_and_refusals():
    logits = torch.tensor([[0.0, 1.0, -1.0]])
    torch.testing.assert_close(activate(logits, "softmax"), torch.softmax(logits, -1))
    torch.testing.assert_close(activate(logits, "sigmoid"), torch.sigmoid(logits))
    torch.testing.assert_close(activate(logits, "identity"), logits)
    config = classifier_config("BertForSequenceClassification", 1)
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    assert classifier_activation(config) == "torch.nn.modules.activation.Tanh"  # as vLLM
    torch.testing.assert_close(activate(logits, classifier_activation(config)), torch.tanh(logits))
    config.sentence_transformers = {"activation_fn": "os.system"}
    with pytest.raises(ValueError, match="only modules of torch.nn load"):
        classifier_activation(config)
    config.sentence_transformers = {"activation_fn": "torch.nn.modules.activation.Nothing"}
    with pytest.raises(ValueError, match="is not a torch.nn module"):
        classifier_activation(config)
    # A null activation_fn is vLLM's default, whatever sbert_ce_default_activation_function says.
    config.sentence_transformers = {"activation_fn": None}
    config.sbert_ce_default_activation_function = "torch.nn.modules.linear.Identity"
    assert classifier_activation(config) == "sigmoid"
    plain = classifier_config("BertForSequenceClassification", 1)
    with pytest.raises(ValueError, match="a sequence classifier's head reads the CLS row"):
        pooler_config_for(None, plain, {"pooling_type": "MEAN"})
    with pytest.raises(ValueError, match="this model's task is 'classify'"):
        pooler_config_for(None, plain, {"task": "embed"})
    assert pooler_config_for(None, plain, {"use_activation": False}).normalize is False


@pytest.mark.parametrize(
    "architecture", ["BertForSequenceClassification", "XLMRobertaForSequenceClassification"]
)
def test_the_head_runs_in_float32_under_a_bfloat16_encoder(architecture):
    """As vLLM's pooling heads: bfloat16 logits would tie two close pairs."""
    config = classifier_config(architecture, 1)
    hf, _ = hf_and_ours(config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        ours = model_class_for(config)(config)
    finally:
        torch.set_default_dtype(previous)
    ours.load_weights(hf.state_dict().items())
    head = [p for name, p in ours.named_parameters() if "classifier" in name or "pooler" in name]
    assert head and all(p.dtype == torch.float32 for p in head)
    assert ours.embeddings.word_embeddings.weight.dtype == torch.bfloat16
    rows = torch.randn(3, config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        logits = ours.classify(rows)
        expected = (
            hf.classifier(rows.float()[:, None, :])
            if "Roberta" in architecture
            else (hf.classifier(hf.bert.pooler.activation(hf.bert.pooler.dense(rows.float()))))
        )
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected.reshape(logits.shape), atol=1e-6, rtol=1e-6)
