"""Sequence classifiers on BERT-family encoders (HF `*ForSequenceClassification`): cross-encoder
rerankers (one label, a relevance score) and text classifiers (several labels).

Each is its encoder (models/bert.py) plus the checkpoint's classification head, applied
to each prompt's first row (CLS) by `classify`: BERT's pooler (dense + tanh) then a linear
classifier; RoBERTa's head (dense + tanh, then out_proj). The pooling runner pools the CLS
rows (models/pooler.py) and calls `classify` on them; the raw logits go to the engine,
which applies the activation a request asks for (`classifier_activation` below, vLLM's
rules). Dropout is an identity at inference and has no weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from aioserve.models.bert import BertModel, RobertaModel
from aioserve.models.linear import Linear

ACTIVATIONS = ("sigmoid", "softmax", "identity")

# sentence-transformers' cross-encoder activation (config.sentence_transformers.activation_fn
# or sbert_ce_default_activation_function), the torch.nn module's qualified name -> ours;
# vLLM reads Sigmoid and Softmax alike: sigmoid for one label, softmax for more ("classify").
_SENTENCE_TRANSFORMERS_ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "classify",
    "torch.nn.modules.activation.Softmax": "classify",
    "torch.nn.modules.linear.Identity": "identity",
}


class BertForSequenceClassification(BertModel):
    """A BERT encoder, BERT's pooler (dense + tanh on the CLS row), a linear classifier."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.pooler_dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.classifier = Linear(config.hidden_size, config.num_labels, bias=True)

    def classify(self, cls_rows: Tensor) -> Tensor:
        """Logits [B, num_labels] (float32) of the prompts' CLS rows [B, hidden]."""
        rows = cls_rows.to(self.classifier.weight.dtype)
        return self.classifier(torch.tanh(self.pooler_dense(rows))).float()

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        name = hf_name.removeprefix("bert.")
        if name.startswith("pooler.dense."):
            return name.replace("pooler.dense.", "pooler_dense."), None
        if name.startswith("classifier."):
            return name, None
        return super().parameter_for(hf_name)


class RobertaClassificationHead(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True)
        self.out_proj = Linear(config.hidden_size, config.num_labels, bias=True)


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa (or XLM-R) encoder and RoBERTa's head: dense + tanh, then out_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)

    def classify(self, cls_rows: Tensor) -> Tensor:
        """Logits [B, num_labels] (float32) of the prompts' CLS rows [B, hidden]."""
        head = self.classifier
        rows = cls_rows.to(head.dense.weight.dtype)
        return head.out_proj(torch.tanh(head.dense(rows))).float()

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.startswith("classifier."):
            return hf_name, None
        return super().parameter_for(hf_name)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass


def classifier_activation(config: PretrainedConfig) -> str:
    """The activation vLLM applies to a classifier's logits (its get_act_fn): by the config's
    problem_type, else the sentence-transformers cross-encoder's activation_fn, else sigmoid
    for one label and softmax for more. ValueError for an activation aioserve lacks."""
    problem_type = getattr(config, "problem_type", None) or ""
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    if problem_type != "single_label_classification":
        settings = getattr(config, "sentence_transformers", None)
        name = settings.get("activation_fn") if isinstance(settings, dict) else None
        name = name or getattr(config, "sbert_ce_default_activation_function", None)
        if name is not None:
            if name not in _SENTENCE_TRANSFORMERS_ACTIVATIONS:
                raise ValueError(
                    f"the cross-encoder's activation {name} is not supported; supported: "
                    f"{', '.join(_SENTENCE_TRANSFORMERS_ACTIVATIONS)}"
                )
            if _SENTENCE_TRANSFORMERS_ACTIVATIONS[name] == "identity":
                return "identity"
    return "sigmoid" if config.num_labels < 2 else "softmax"


def activate(logits: Tensor, activation: str) -> Tensor:
    """A classifier's logits [..., num_labels] through `activation` (ACTIVATIONS)."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits
