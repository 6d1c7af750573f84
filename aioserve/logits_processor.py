"""Custom logits processors (`--logits-processors`): the interface a processor implements.

The shape is vLLM v1's (`vllm.v1.sample.logits_processor`), so that a processor written
for vLLM ports by changing its imports. A processor is a class, named on the command line
as `module.path:ClassName` (or passed as the class to `LLM(logits_processors=[...])`). The
engine builds one instance at start; before each step that samples it calls
`update_state` with what changed in the batch since the last one, then `apply` with the
step's logits, float32 [rows, vocabulary], row i being batch index i.

A request's own arguments for a processor come in `SamplingParams.extra_args` (over HTTP,
the body's `vllm_xargs`); `validate_params` may refuse them when the request arrives (a
`ValueError`: HTTP 400).

What differs from vLLM: the first constructor argument is a `ProcessorConfig` (vLLM
passes its VllmConfig); every processor runs on the logits before aioserve's own
processing (logit bias, allowed tokens, structured-output masks, penalties, temperature,
min-p, top-k, top-p), argmax-invariant ones too (vLLM applies those after the
temperature); a step whose rows are all greedy skips the argmax-invariant ones, as vLLM's
does. The raw logprobs modes report the logits before any processor, as vLLM's do.
"""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Any

import torch


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the request at index a moves to index b; a is then empty
    SWAP = auto()  # the requests at indices a and b trade places


RemovedRequest = int  # the batch index a request left
# (batch index, its SamplingParams, its prompt's token ids (None for a prompt of
# embeddings), its output token ids): the last is the runner's own list, which grows as
# the request samples, so a processor that keeps it sees every token sampled so far.
AddedRequest = tuple[int, Any, "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]  # (index a, index b, how)


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the batch since the step before: process `removed`, then `added`
    (an added request may take an index that held another), then `moved`, in order."""

    batch_size: int  # rows this step
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True)
class ProcessorConfig:
    """What a processor learns of the engine that builds it."""

    model: str
    vocab_size: int
    max_num_seqs: int  # the most rows a step's logits have
    max_model_len: int
    engine_config: Any  # the whole aioserve.config.engine.EngineConfig


class LogitsProcessor(ABC):
    """A processor of every sampling row of every step (vLLM v1's interface)."""

    @classmethod  # noqa: B027 (optional: by default every request is accepted)
    def validate_params(cls, sampling_params: Any) -> None:
        """Raise ValueError for a request whose parameters (extra_args) this processor
        refuses; the request is then refused (HTTP 400) before it runs."""

    @abstractmethod
    def __init__(self, vllm_config: ProcessorConfig, device: torch.device, is_pin_memory: bool):
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits, float32 [batch_size, vocabulary], changed; may change them in
        place and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the highest logit."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each step that samples; `batch_update` is None when the batch is
        what it was."""
        raise NotImplementedError


RequestLogitsProcessor = (
    Callable[[list[int], torch.Tensor], torch.Tensor]
    | Callable[[list[int], list[int], torch.Tensor], torch.Tensor]
)


class AdapterLogitsProcessor(LogitsProcessor):
    """A per-request function turned into a batch processor (vLLM's adapter).

    A subclass implements `is_argmax_invariant` and `new_req_logits_processor(params)`,
    which returns for a request a function `(output_ids, logits_row) -> logits_row` (or
    `(prompt_ids, output_ids, logits_row) -> logits_row`), or None to leave it alone.
    """

    def __init__(self, vllm_config: ProcessorConfig, device: torch.device, is_pin_memory: bool):
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: Any) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(
        self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        function = self.new_req_logits_processor(params)
        if function is None:
            return None
        if len(inspect.signature(function).parameters) == 3:
            if prompt_ids is None:
                raise ValueError(
                    "this logits processor needs the prompt's token ids; a prompt of "
                    "embeddings has none"
                )
            return partial(function, prompt_ids, output_ids)
        return partial(function, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        entries = self.req_info
        for index in batch_update.removed:
            entries.pop(index, None)
        for index, params, prompt_ids, output_ids in batch_update.added:
            state = self._new_state(params, prompt_ids, output_ids)
            if state is None:
                entries.pop(index, None)
            else:
                entries[index] = state
        for a, b, how in batch_update.moved:
            a_state, b_state = entries.pop(a, None), entries.pop(b, None)
            if a_state is not None:
                entries[b] = a_state
            if b_state is not None and how is MoveDirectionality.SWAP:
                entries[a] = b_state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, function in self.req_info.items():
            row = logits[index]
            changed = function(row)
            if changed is not row:
                logits[index] = changed
        return logits


def load_processor_classes(entries: Sequence[str | type]) -> list[type[LogitsProcessor]]:
    """The classes `--logits-processors` names: `module.path:ClassName` strings (imported
    here) or classes. Raises ValueError naming the flag and the entry at fault."""
    classes = []
    for entry in entries:
        if isinstance(entry, str):
            module_name, colon, qualname = entry.partition(":")
            if not colon or not module_name or not qualname or ":" in qualname:
                raise ValueError(
                    f"--logits-processors: {entry!r} is not '<module>:<class>' "
                    "(e.g. my_package.processors:NoRepeatProcessor)"
                )
            try:
                found: Any = importlib.import_module(module_name)
                for attribute in qualname.split("."):
                    found = getattr(found, attribute)
            except Exception as error:
                raise ValueError(
                    f"--logits-processors: cannot load {entry!r}: {type(error).__name__}: {error}"
                ) from error
            entry = found
        if not (isinstance(entry, type) and issubclass(entry, LogitsProcessor)):
            raise ValueError(
                f"--logits-processors: {entry!r} is not a subclass of "
                "aioserve.logits_processor.LogitsProcessor"
            )
        classes.append(entry)
    return classes


def build_processors(
    classes: Sequence[type[LogitsProcessor]], config: ProcessorConfig, device: torch.device
) -> list[LogitsProcessor]:
    """One instance of each class, built as vLLM builds them (config, device, pinned)."""
    return [cls(config, device, device.type == "cuda") for cls in classes]
