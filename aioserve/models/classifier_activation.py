"""Which activation a sequence classifier's logits go through, and applying it: vLLM 0.32's
rules (model_executor/layers/pooler/activations.py, get_act_fn).

By the config's `problem_type` first (regression: none; multi-label: sigmoid; single
label: the default below); else the sentence-transformers cross-encoder's activation
(`sentence_transformers.activation_fn`, or else `sbert_ce_default_activation_function`):
Sigmoid and Softmax both mean the default, Identity none, and any other module of
torch.nn (Tanh, ReLU, ...) itself, as vLLM instantiates it (nothing outside torch.nn,
for safety, as vLLM); else the default: sigmoid for one label, softmax for more.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

_TORCH_NN_PREFIX = "torch.nn.modules."
_DEFAULT_MEANING = ("torch.nn.modules.activation.Sigmoid", "torch.nn.modules.activation.Softmax")
_IDENTITY = "torch.nn.modules.linear.Identity"


def classifier_activation(config: PretrainedConfig) -> str:
    """ "sigmoid", "softmax", "identity", or a torch.nn module's qualified name."""
    problem_type = getattr(config, "problem_type", None) or ""
    if problem_type == "regression":
        return "identity"
    if problem_type == "multi_label_classification":
        return "sigmoid"
    name = None
    if problem_type != "single_label_classification":
        settings = getattr(config, "sentence_transformers", None)
        if isinstance(settings, dict) and "activation_fn" in settings:
            name = settings["activation_fn"]
        else:
            name = getattr(config, "sbert_ce_default_activation_function", None)
    if name is not None and name not in _DEFAULT_MEANING:
        if name == _IDENTITY:
            return "identity"
        _torch_module(name)  # refused now rather than at the first request
        return name
    return "sigmoid" if config.num_labels < 2 else "softmax"


def activate(logits: Tensor, activation: str) -> Tensor:
    """A classifier's logits [..., num_labels] through `activation` (classifier_activation's)."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "identity":
        return logits
    return _torch_module(activation)(logits)


def _torch_module(name: str) -> nn.Module:
    """An instance of the torch.nn module named `name` ("torch.nn.modules.activation.Tanh")."""
    if not name.startswith(_TORCH_NN_PREFIX):
        raise ValueError(
            f"the classifier's activation {name} is refused: only modules of torch.nn load, "
            "as in vLLM"
        )
    module_path, _, class_name = name.rpartition(".")
    module_class = getattr(__import__(module_path, fromlist=[class_name]), class_name, None)
    if not (isinstance(module_class, type) and issubclass(module_class, nn.Module)):
        raise ValueError(f"the classifier's activation {name} is not a torch.nn module")
    return module_class()
