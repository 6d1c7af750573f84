"""Which layers of a model attend through a sliding window, and how wide it is.

A config's `sliding_window` W limits a layer's attention to the last W positions (its own
included: kernels/attention.py). As in vLLM and transformers, `layer_types` says which
layers it applies to ("sliding_attention"; the others are "full_attention": Gemma 3's
global layers, Qwen2's first `max_window_layers`); without `layer_types` it applies to
every layer (Mistral v0.1, Phi-3-mini-4k). Qwen2's `use_sliding_window: false` turns it
off, and so does --disable-sliding-window (`disable_sliding_window`, which also caps the
context at the window: engine/resolution.py).
"""

from __future__ import annotations

from transformers import PretrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


def configured_window(config: PretrainedConfig) -> int:
    """The config's sliding window, 0 where it has none or turns it off."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return 0
    return int(window)


def layer_sliding_windows(config: PretrainedConfig) -> list[int]:
    """Each layer's sliding window, 0 for a layer that attends its whole context."""
    count = config.num_hidden_layers
    window = configured_window(config)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * count
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer types {', '.join(unknown)} are not supported yet")
    if len(layer_types) != count:
        raise ValueError(f"layer_types names {len(layer_types)} layers, the model has {count}")
    return [window if kind == "sliding_attention" else 0 for kind in layer_types]


def disable_sliding_window(config: PretrainedConfig) -> None:
    """--disable-sliding-window: every layer attends its whole context (vLLM's meaning: the
    window is dropped from the config)."""
    config.sliding_window = None
