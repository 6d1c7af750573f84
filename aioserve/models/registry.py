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
from aioserve.models.llava import LlavaForConditionalGeneration

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
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
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


MODEL_IMPLS = ("auto", "vllm", "transformers")
"""--model-impl: aioserve's own implementation where it has one, else the Transformers
backend (auto); aioserve's own only (vllm, vLLM's name for its native models); the
Transformers backend (transformers, models/transformers_backend.py)."""


def native_architecture(config: PretrainedConfig) -> str | None:
    """The first of the config's `architectures` that aioserve implements, None if none."""
    architectures = getattr(config, "architectures", None) or []
    return next((a for a in architectures if a in MODEL_CLASSES), None)


def architecture_for(config: PretrainedConfig) -> str:
    """The first of the config's `architectures` that aioserve implements."""
    architecture = native_architecture(config)
    if architecture is None:
        architectures = getattr(config, "architectures", None) or []
        raise ValueError(
            f"model architectures {architectures} are not supported yet; "
            f"supported: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return architecture


def model_class_for(config: PretrainedConfig, model_impl: str = "vllm") -> type[nn.Module]:
    """The class that runs the config's model under --model-impl `model_impl`; a
    ValueError saying why when none can."""
    from aioserve.models.transformers_backend import (
        TransformersForCausalLM,
        transformers_causal_lm_class,
    )

    native = native_architecture(config)
    if model_impl == "vllm" or (model_impl == "auto" and native is not None):
        if native is None:
            architecture_for(config)  # raises: not supported, and which are
        return MODEL_CLASSES[native]
    try:
        transformers_causal_lm_class(config)
    except ValueError as error:
        if model_impl == "transformers":
            raise ValueError(f"--model-impl transformers: {error}") from None
        architectures = getattr(config, "architectures", None) or []
        raise ValueError(
            f"model architectures {architectures} are not supported yet (aioserve "
            f"implements {', '.join(sorted(MODEL_CLASSES))}), and its Transformers backend "
            f"cannot run them: {error}"
        ) from None
    return TransformersForCausalLM


def is_pooling_architecture(config: PretrainedConfig) -> bool:
    """Whether the config's model is an encoder-only pooling (embedding) model: no KV cache,
    no sampling, one vector a prompt (models/pooler.py); False for one aioserve does not
    implement (the Transformers backend may run it: `model_class_for`)."""
    return native_architecture(config) in POOLING_ARCHITECTURES
