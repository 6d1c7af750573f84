"""Engines built one after another in one process (a notebook, a script, this test suite):
a closed engine leaves nothing behind, and the next one is built as the first was.

An engine freezes the heap once built (process_tuning.py): before its shutdown unfroze it,
the reference cycles of a closed engine's compiled model were never collected (~330 MB
a SmolLM2 engine). The KV pool's zeroing thread set torch's thread count to 1 for every
thread started afterwards, so the next engine stepped its model on one core. And every
engine's one-row graph stayed on the one code object they shared, until dynamo's recompile
limit refused the ninth engine's (counted when a new model's objects land at a closed
one's addresses, as they do): each engine's graph is now compiled ahead of time and kept
by its step, on no code object. That graph is compiled for the engine's own sizes: dynamo,
having seen another block size in the process, took it as dynamic and could not compile
the step.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from aioserve import LLM, SamplingParams
from aioserve.runner.one_row_step import forward_and_logits
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

pytestmark = pytest.mark.slow

PROMPT = {"prompt_token_ids": [5, 17, 99, 3, 42, 7]}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("tiny_llama"))


def _engine(folder, block_size: int) -> LLM:
    """A compiled bfloat16 engine, whose decodes at one stream run the one-row graph."""
    llm = LLM(
        model=str(folder),
        dtype="bfloat16",
        max_model_len=256,
        block_size=block_size,
        skip_tokenizer_init=True,
    )
    assert llm.engine.runner.model_step.compiled
    return llm


def _greedy(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def _model_thread_cores(llm: LLM) -> int:
    return llm.engine._model_thread.submit(torch.get_num_threads).result()


@pytest.fixture
def two_threads():
    """Two torch threads at least, as a served process has on two cores (an xdist worker
    may run on one), so that a later engine's model thread left on one core shows."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, 2))
    yield
    torch.set_num_threads(before)


def test_a_closed_engine_is_collected_and_the_next_is_built_alike(tiny_folder, two_threads):
    thresholds, switch_interval = gc.get_threshold(), sys.getswitchinterval()
    first = _engine(tiny_folder, block_size=16)
    tokens = _greedy(first)
    cores = _model_thread_cores(first)
    assert cores >= 2
    assert first.engine.runner.model_step._one_row.ready
    assert not _debug_get_cache_entry_list(forward_and_logits.__code__)
    model = weakref.ref(first.engine.runner.model)
    first.close()
    assert gc.get_freeze_count() == 0
    assert (gc.get_threshold(), sys.getswitchinterval()) == (thresholds, switch_interval)
    assert model() is None, "close() should free the model, though `first` is still held"
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        _greedy(first)
    first.close()  # a second close does nothing

    # Another block size: the one-row graph is compiled for the pool's own sizes, not
    # for sizes dynamo saw change since the first engine's (which it could not compile).
    second = _engine(tiny_folder, block_size=8)
    try:
        assert second.engine.runner.model_step._one_row.ready
        assert _model_thread_cores(second) == cores
        assert _greedy(second) == tokens
    finally:
        second.close()
