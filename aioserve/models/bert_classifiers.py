"""Sequence classifiers on BERT-family encoders (HF `*ForSequenceClassification`): cross-encoder
rerankers (one label, a relevance score) and text classifiers (several labels).

Each is its encoder (models/bert.py) plus the checkpoint's classification head, applied
to each prompt's first row (CLS) by `classify`: a dense layer and tanh, then a projection
to the labels (BERT's pooler then its classifier; RoBERTa's dense then out_proj). The
pooling runner pools the CLS rows (models/pooler.py) and calls `classify` on them; the
raw logits go to the engine, which applies the activation a request asks for
(models/classifier_activation.py). Dropout is an identity at inference and has no weights.

The head runs in float32 whatever the encoder's dtype, as vLLM's pooling heads do: its
weights are kept in float32 (plain torch Linears, which the encoder's packing for oneDNN
leaves alone). In bfloat16 two close logits would otherwise tie, a step of 1/16 at 8.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from aioserve.models.bert import BertModel, RobertaModel


def _float32_linear(config: PretrainedConfig, outputs: int) -> nn.Linear:
    return nn.Linear(config.hidden_size, outputs, bias=True, dtype=torch.float32)


def _head(cls_rows: Tensor, dense: nn.Linear, projection: nn.Linear) -> Tensor:
    """Logits [B, labels] (float32): projection(tanh(dense(CLS rows))), in float32."""
    return projection(torch.tanh(dense(cls_rows.float())))


class BertForSequenceClassification(BertModel):
    """A BERT encoder, BERT's pooler (dense + tanh on the CLS row), a linear classifier."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.pooler_dense = _float32_linear(config, config.hidden_size)
        self.classifier = _float32_linear(config, config.num_labels)

    def classify(self, cls_rows: Tensor) -> Tensor:
        """Logits [B, num_labels] (float32) of the prompts' CLS rows [B, hidden]."""
        return _head(cls_rows, self.pooler_dense, self.classifier)

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
        self.dense = _float32_linear(config, config.hidden_size)
        self.out_proj = _float32_linear(config, config.num_labels)


class RobertaForSequenceClassification(RobertaModel):
    """A RoBERTa (or XLM-R) encoder and RoBERTa's head: dense + tanh, then out_proj."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)

    def classify(self, cls_rows: Tensor) -> Tensor:
        """Logits [B, num_labels] (float32) of the prompts' CLS rows [B, hidden]."""
        return _head(cls_rows, self.classifier.dense, self.classifier.out_proj)

    def parameter_for(self, hf_name: str) -> tuple[str, int | None] | None:
        if hf_name.startswith("classifier."):
            return hf_name, None
        return super().parameter_for(hf_name)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
