"""vLLM's Transformers modeling backend: a causal LM that aioserve does not implement itself,
run by its own Transformers code with aioserve's paged attention (`--model-impl`).

Transformers lets a model's attention modules call a registered function in place of their
own (its AttentionInterface). `TransformersForCausalLM` builds the model with the function
registered here as its attention: each layer hands its rotated queries, keys and values to
`attend_layer` (models/paged_attention_op.py), which writes the keys and values into that
layer's blocks of the paged KV cache and attends over the sequence's cached context, as
aioserve's own models do. Everything else — embeddings, norms, rotary, MLPs — is the
Transformers code as it is, run eagerly on the step's flat batch of tokens (one "sequence"
of all the step's tokens, whose positions say where each token stands in its own).

The head is taken apart from the model's forward, as vLLM's backend takes it: the output
embeddings, then the config's `logit_scale` (Cohere) and `final_logit_softcapping` (Gemma
2 and 3), then float32.

What this first version does not do (each refused by name when asked for): compiling the
step or replaying decode graphs (it runs eagerly), quantized or GGUF checkpoints, LoRA,
attention soft-capping (Gemma 2) and attention sinks, and pooling models. Only
architectures whose Transformers class declares that it supports attention backends
(`_supports_attention_backend`) are taken: the others compute attention in their own code,
which would never see the KV cache.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import transformers
from torch import Tensor, nn
from transformers import AttentionInterface, PretrainedConfig
from transformers.conversion_mapping import (
    WeightConverter,
    WeightRenaming,
    get_model_conversion_mapping,
)
from transformers.core_model_loading import rename_source_key
from transformers.initialization import no_init_weights
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from aioserve.models.paged_attention_op import attend_layer
from aioserve.models.prompt_embeds import PromptEmbeds, with_prompt_embeds

logger = logging.getLogger("aioserve")

ATTENTION_IMPLEMENTATION = "aioserve"
_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


@dataclass(frozen=True)
class LayerGeometry:
    """What one layer's attention hands over: query and key/value heads, head size, its
    sliding window (0: none)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int


# Set while a model is probed: its layers report their geometry instead of attending.
_probed: contextvars.ContextVar[dict[int, LayerGeometry] | None] = contextvars.ContextVar(
    "aioserve_probed_layers", default=None
)


def _paged_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    **_: object,
) -> tuple[Tensor, None]:
    """Transformers' attention call for one layer: query [1, Hq, T, D], key and value
    [1, Hkv, T, D] -> ([1, T, Hq, D], no weights). The causal mask is the step's (the
    attention metadata), not `attention_mask`, which the mask function below leaves None."""
    layer_index = getattr(module, "layer_idx", None)
    if layer_index is None:
        raise ValueError(f"{type(module).__name__} does not say which layer it is (layer_idx)")
    if softcap is not None:
        raise ValueError("attention soft-capping (Gemma 2's) is not supported by aioserve yet")
    if s_aux is not None:
        raise ValueError("attention sinks are not supported by aioserve's Transformers backend yet")
    probed = _probed.get()
    if probed is not None:
        probed[layer_index] = LayerGeometry(
            query.shape[1], key.shape[1], query.shape[-1], sliding_window or 0
        )
        return query.transpose(1, 2), None
    head_dim = query.shape[-1]
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    rows = [x[0].transpose(0, 1).contiguous() for x in (query, key, value)]  # [T, H, D]
    out = attend_layer(*rows, layer_index, scale, sliding_window or 0)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _paged_attention)
# No mask is built: the paged attention masks by the step's metadata.
AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, lambda *args, **kwargs: None)


def transformers_causal_lm_class(config: PretrainedConfig) -> type[transformers.PreTrainedModel]:
    """The Transformers class of the config's first architecture, checked to suit the
    backend; a ValueError saying why not otherwise."""
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError("the model's config names no architecture")
    name = architectures[0]
    cls = getattr(transformers, name, None)
    if cls is None or not isinstance(cls, type):
        raise ValueError(
            f"{name} is not a model of the installed Transformers "
            f"({transformers.__version__}); remote code is not run by this backend"
        )
    if name not in _CAUSAL_LM_CLASSES:
        raise ValueError(
            f"{name} is not a causal language model: the Transformers backend serves "
            "those only for now"
        )
    if not cls._supports_attention_backend:
        raise ValueError(
            f"the Transformers implementation of {name} computes attention in its own code "
            "(it does not support attention backends), so it cannot read the paged KV cache"
        )
    if getattr(config.get_text_config(), "attn_logit_softcapping", None):
        raise ValueError(
            f"{name} soft-caps its attention scores, which aioserve's attention does not do yet"
        )
    return cls


class TransformersForCausalLM(nn.Module):
    """A Transformers causal LM behind aioserve's model interface: `forward(input_ids,
    positions, embeds)` -> hidden rows, `compute_logits(rows)`, `load_weights(weights)`.

    Built on the current default device and dtype (models/loader.py sets them), without
    random initialization: the checkpoint fills every weight. The KV-cache geometry is read
    from the model's own attention calls (one probe step of one token), so that
    `config.num_key_value_heads` and `config.head_dim` hold what the layers actually hand
    over (GPT-BigCode's single key/value head, for one).
    """

    compiles = False  # the step runs eagerly: no compiled layers, no decode graphs

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        cls = transformers_causal_lm_class(config)
        text_config = config.get_text_config()
        text_config._attn_implementation = ATTENTION_IMPLEMENTATION
        config._attn_implementation = ATTENTION_IMPLEMENTATION
        with no_init_weights():
            self.causal_lm = cls._from_config(config, dtype=torch.get_default_dtype())
        self.causal_lm.tie_weights()  # a tied head is the embedding table (not done above)
        self.config = config
        self.logit_scale = float(getattr(text_config, "logit_scale", None) or 1.0)
        self.final_softcap = getattr(text_config, "final_logit_softcapping", None)
        self._set_kv_geometry(self._probe())
        logger.info(
            "Using the Transformers modeling backend for %s (its step runs eagerly)",
            type(self.causal_lm).__name__,
        )

    @property
    def base(self) -> nn.Module:
        """The decoder: the model under its head."""
        return self.causal_lm.get_decoder()

    @property
    def head(self) -> nn.Module:
        return self.causal_lm.get_output_embeddings()

    def _probe(self) -> list[LayerGeometry]:
        """Every layer's attention geometry, from one step of one token."""
        layers: dict[int, LayerGeometry] = {}
        token = _probed.set(layers)
        try:
            device = self.head.weight.device
            ids = torch.zeros((1, 1), dtype=torch.int64, device=device)
            with torch.inference_mode():
                self.base(input_ids=ids, position_ids=ids, use_cache=False)
        finally:
            _probed.reset(token)
        count = self.config.get_text_config().num_hidden_layers
        if sorted(layers) != list(range(count)):
            raise ValueError(
                f"{type(self.causal_lm).__name__}: only layers {sorted(layers)} of {count} "
                "called the attention backend, so the others would not use the KV cache"
            )
        return [layers[i] for i in range(count)]

    def _set_kv_geometry(self, layers: list[LayerGeometry]) -> None:
        shapes = {(g.num_heads, g.num_kv_heads, g.head_dim) for g in layers}
        if len(shapes) != 1:
            raise ValueError(
                "layers with different attention shapes are not supported by aioserve's "
                f"Transformers backend yet: {sorted(shapes)}"
            )
        num_heads, num_kv_heads, head_dim = shapes.pop()
        text_config = self.config.get_text_config()
        text_config.num_key_value_heads = num_kv_heads
        text_config.head_dim = head_dim
        if text_config is not self.config:
            self.config.num_key_value_heads = num_kv_heads
            self.config.head_dim = head_dim
        self.layer_geometry = layers

    def forward(
        self, input_ids: Tensor, positions: Tensor, embeds: PromptEmbeds | None = None
    ) -> Tensor:
        """Hidden states [T, hidden] of the step's flat batch; run inside the step context,
        as aioserve's own models are."""
        hidden = with_prompt_embeds(self.base.get_input_embeddings()(input_ids), embeds)
        out = self.base(
            inputs_embeds=hidden.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            return_dict=False,
        )
        return out[0][0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        logits = self.head(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        logits = logits.float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copy checkpoint tensors, named as the Transformers class names them, into the
        model; the names of the parameters filled (as `named_parameters` gives them)."""
        params = dict(self.causal_lm.named_parameters(remove_duplicate=False))
        params |= dict(self.causal_lm.named_buffers())
        first_name = {id(p): name for name, p in self.causal_lm.named_parameters()}
        mappings = get_model_conversion_mapping(self.causal_lm)
        renamings = [m for m in mappings if isinstance(m, WeightRenaming)]
        converters = [m for m in mappings if isinstance(m, WeightConverter)]
        prefix = self.causal_lm.base_model_prefix
        loaded: set[str] = set()
        unexpected = []
        with torch.no_grad():
            for stored_name, tensor in weights:
                # Transformers' renamings of older checkpoints (GPT-NeoX's embed_out is its
                # lm_head now), and the base model's prefix added or dropped.
                name, converter = rename_source_key(
                    stored_name, renamings, converters, prefix, params
                )
                if converter is not None:
                    raise ValueError(
                        f"checkpoint tensor {stored_name} needs Transformers' conversion "
                        f"({converter}), which aioserve's Transformers backend does not apply yet"
                    )
                target = params.get(name)
                if target is None:
                    unexpected.append(stored_name)
                    continue
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"checkpoint tensor {stored_name} has shape {tuple(tensor.shape)}, the "
                        f"model's {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                if id(target) in first_name:
                    loaded.add("causal_lm." + first_name[id(target)])
        if unexpected:
            shown = ", ".join(unexpected[:5]) + (" …" if len(unexpected) > 5 else "")
            raise ValueError(
                f"{len(unexpected)} checkpoint tensors have no place in "
                f"{type(self.causal_lm).__name__}: {shown}"
            )
        return loaded
