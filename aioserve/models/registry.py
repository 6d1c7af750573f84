"""From a HF config's `architectures` to the class that implements it, and which of them
are encoder-only pooling (embedding) models rather than generative ones."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from aioserve.models.bert import BertModel, RobertaModel, XLMRobertaModel
from aioserve.models.bert_classifiers import (
    BertForSequenceClassification,
    RobertaForSequenceClassification,
    XLMRobertaForSequenceClassification,
)
from aioserve.models.gemma import Gemma3ForCausalLM, GemmaForCausalLM
from aioserve.models.llama import (
    GraniteForCausalLM,
    GraniteMoeForCausalLM,
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    OlmoeForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    SmolLM3ForCausalLM,
)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "BertModel": BertModel,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
}

# The pooling architectures, each with its sequence pooling where neither the user nor
# sentence-transformers' files say (vLLM's `default_pooling_type` of the class it maps the
# architecture to: BertModel -> BertEmbeddingModel, CLS). Their models' forward takes the
# packed prompts (input_ids, positions, cu_seqlens, max_seqlen) and uses no KV cache.
POOLING_ARCHITECTURES: dict[str, str] = {
    "BertModel": "CLS",
    "RobertaModel": "CLS",  # vLLM's RobertaEmbeddingModel
    "XLMRobertaModel": "CLS",
    "BertForSequenceClassification": "CLS",
    "RobertaForSequenceClassification": "CLS",
    "XLMRobertaForSequenceClassification": "CLS",
}
# The pooling architectures whose task is `classify` (a head on the CLS row: cross-encoders
# and text classifiers, models/bert_classifiers.py); the others' is `embed`.
CLASSIFY_ARCHITECTURES = frozenset(
    {
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    }
)


def architecture_for(config: PretrainedConfig) -> str:
    """The first of the config's `architectures` that aioserve implements."""
    architectures = getattr(config, "architectures", None) or []
    for architecture in architectures:
        if architecture in MODEL_CLASSES:
            return architecture
    raise ValueError(
        f"model architectures {architectures} are not supported yet; "
        f"supported: {', '.join(sorted(MODEL_CLASSES))}"
    )


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    return MODEL_CLASSES[architecture_for(config)]


def is_pooling_architecture(config: PretrainedConfig) -> bool:
    """Whether the config's model is an encoder-only pooling (embedding) model: no KV cache,
    no sampling, one vector a prompt (models/pooler.py). ValueError when aioserve
    implements none of its architectures."""
    return architecture_for(config) in POOLING_ARCHITECTURES
