"""runner/sleep_memory.py at small shapes: the KV storages freed and given back zeroed
(memory handed out again may hold anything), the weights discarded and reloaded, the
decode graphs captured again only when what they read has moved."""

from __future__ import annotations

import torch
from torch import nn

from aioserve.runner.sleep_memory import SleepingMemory, level_2_refusal


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(64, 32)


def _kv() -> list:
    return [(torch.empty(8, 16, 2, 32), torch.empty(8, 16, 2, 32)) for _ in range(2)]


def test_a_wake_gives_the_pool_back_zeroed_and_recaptures_once():
    kv, recaptured = _kv(), []
    for key, value in kv:
        key.fill_(float("nan"))
        value.fill_(float("nan"))
    memory = SleepingMemory(
        _model(), kv, torch.device("cpu"), recapture=lambda: recaptured.append(1)
    )
    memory.sleep(1)
    assert all(t.untyped_storage().nbytes() == 0 for pair in kv for t in pair)
    assert not memory.kv_resident and memory.weights_resident  # the CPU keeps the weights
    memory.wake_up(["weights"])
    assert not recaptured  # the pool is still away
    memory.wake_up(["kv_cache"])
    assert all(torch.count_nonzero(t) == 0 for pair in kv for t in pair)
    assert memory.recaptures == 1 and recaptured == [1]


def test_level_2_reloads_the_weights_in_place():
    model = _model()
    weight, before = model.weight, model.weight.clone()
    memory = SleepingMemory(model, _kv(), torch.device("cpu"), reload=_model)
    memory.sleep(2)
    assert weight.untyped_storage().nbytes() == 0
    memory.wake_up(None)
    assert model.weight is weight and torch.equal(weight, before)


def test_level_2_is_refused_for_lora_slots():
    model = _model()
    assert level_2_refusal(model) is None
    model.lora_a = torch.zeros(2, 2)
    assert "LoRA" in level_2_refusal(nn.Sequential(model))
