"""Which layers attend through a sliding window: transformers' configs read as vLLM reads
them (layer_types where the config has them, else every layer)."""

from __future__ import annotations

import pytest
from transformers import MistralConfig, Phi3Config, Qwen2Config

from aioserve.models.sliding_windows import disable_sliding_window, layer_sliding_windows


def test_a_window_without_layer_types_is_every_layers():
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3)) == [4096] * 3
    phi3_mini_4k = Phi3Config(num_hidden_layers=2, sliding_window=2047)
    assert layer_sliding_windows(phi3_mini_4k) == [2047, 2047]
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [0, 0]


def test_qwen2_windows_the_layers_past_max_window_layers_when_asked():
    config = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=1
    )
    assert layer_sliding_windows(config) == [0, 8, 8, 8]
    config = Qwen2Config(num_hidden_layers=4, sliding_window=8, max_window_layers=1)
    assert layer_sliding_windows(config) == [0, 0, 0, 0]  # use_sliding_window is off


def test_layer_types_say_which_layers_slide():
    config = MistralConfig(num_hidden_layers=3, sliding_window=16)
    config.layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    assert layer_sliding_windows(config) == [16, 16, 0]


def test_unknown_layer_types_and_miscounted_ones_are_refused():
    config = MistralConfig(num_hidden_layers=2, sliding_window=16)
    config.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="layer types chunked_attention are not supported"):
        layer_sliding_windows(config)
    config.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="names 1 layers, the model has 2"):
        layer_sliding_windows(config)


def test_disable_sliding_window_attends_every_layer_whole():
    config = MistralConfig(num_hidden_layers=2, sliding_window=16)
    config.layer_types = ["sliding_attention", "full_attention"]
    disable_sliding_window(config)
    assert layer_sliding_windows(config) == [0, 0]
