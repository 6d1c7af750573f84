"""Runs model steps: owns the model, the KV-cache memory, the per-sequence slots, sampling.

A step goes through three calls, on two threads:

- `prepare(plan)` on the event loop's thread: host work only (numpy). Sequences enter and
  leave their slots, and the step's token layout and sampling rows are built.
- `execute(step)` on the model thread, in step order: the slot changes reach the device,
  the inputs are copied there, the model runs, the prompt tokens of sequences that want
  prompt logprobs are scored (prompt_logprobs.py) and the sampler draws, once the
  structured-output masks of the step (if any) are ready. It returns a
  `StepOutput` as soon as the work is queued on the device (on the CPU, once it is done).
- `collect(output)` on the event loop's thread, once `output.is_ready()` (else after
  `output.wait()` off the loop): the host learns the sampled tokens.

While step N executes, step N+1 can be prepared: it only touches the host halves of the
slots, and a decode of a token step N samples reads it from the device
(`SlotTensors.last_sampled`), never from the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from aioserve.kernels.sampling import (
    LOGPROBS_MODES,
    LogprobsTensors,
    SamplerOutput,
    make_sampling_batch,
    sample,
)
from aioserve.logits_processor import LogitsProcessor
from aioserve.models.step_context import step_context
from aioserve.runner.compiled_step import ModelStep
from aioserve.runner.cudagraph_stats import CUDAGraphSettings, CUDAGraphStat
from aioserve.runner.custom_logits import CustomLogitsProcessors, ProcessorRows
from aioserve.runner.decode_graphs import DecodeGraphs
from aioserve.runner.kv_memory import allocate_kv_caches, layer_kv_scales
from aioserve.runner.lora_slots import LoRASlots, SlotLoad
from aioserve.runner.prompt_logprobs import (
    HostPromptLogprobs,
    collect_prompt_logprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from aioserve.runner.sampler_graphs import CompiledRace, compile_race
from aioserve.runner.sampling_inputs import HostSampling, build_host_sampling
from aioserve.runner.sequence_slots import SequenceSlots, SlotAdmission, SlotTensors
from aioserve.runner.speculative_rows import (
    DraftRows,
    KeptRows,
    attend_drafts_as_decodes,
    draft_rows,
    expand_logits_indices,
    kept_rows,
    record_kept,
)
from aioserve.runner.step_inputs import HostStepInputs, build_host_inputs, host_to_device
from aioserve.runner.step_plan import StepPlan, StepResult, TokenBitmask, TokenLogprobs
from aioserve.runner.thinking_budget import ThinkingBudgets, ThinkingMarkers, ThoughtRows


@dataclass
class PreparedStep:
    admissions: list[SlotAdmission]  # applied to the device state before the step
    inputs: HostStepInputs
    sampling: HostSampling | None
    sampled_seq_ids: list[str]  # the sequences that sample, in logits row order
    num_tokens: int  # the step's tokens, before any padding
    prompt_logprobs: HostPromptLogprobs | None = None
    token_bitmask: TokenBitmask | None = None  # structured-output masks, filled late
    lora_loads: list[SlotLoad] | None = None  # adapters copied into their slots first
    lora_token_slots: list[int] | None = None  # each token's LoRA slot (-1: none)
    processor_rows: ProcessorRows | None = None  # the rows as custom logits processors see them
    thought_rows: ThoughtRows | None = None  # the rows with a thinking budget


@dataclass
class StepOutput:
    """A step's sampled tokens, on their way to the host."""

    sampled_seq_ids: list[str]
    sampler: SamplerOutput | None
    logprobs_wanted: list[int | None]
    done: torch.cuda.Event | None = None  # recorded after the copies to the host (GPU)
    prompt_logprobs: tuple[HostPromptLogprobs, LogprobsTensors] | None = None
    # logprob_token_ids: the rows that chose tokens, and their values in the logprobs
    # mode (float32 [rows, most chosen], in each row's order)
    chosen: ChosenLogprobs | None = None
    # A step with drafts: its rows, the rows each sequence kept (on the device until the
    # step is done) and each sampling sequence's slot.
    drafts: tuple[DraftRows, KeptRows, np.ndarray] | None = None

    def is_ready(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        compile_model: bool = False,
        row_weight_dtype: torch.dtype | None = None,
        packed_weights: bool = False,
        decode_graph_sizes: list[int] | None = None,
        max_seq_len_to_capture: int = 0,
        kv_cache_dtype: torch.dtype | None = None,
        calculate_kv_scales: bool = False,
        logprobs_mode: str = "raw_logprobs",
        lora_slots: tuple[int, int, torch.dtype] | None = None,
        logits_processors: list[LogitsProcessor] | None = None,
        thinking_markers: ThinkingMarkers | None = None,
    ) -> None:
        """`lora_slots`: (max_loras, max_lora_rank, dtype) to serve LoRA adapters
        (lora_slots.py); decode steps then run without decode graphs. `logits_processors`:
        the custom ones (--logits-processors, custom_logits.py), built for this runner.
        `thinking_markers`: the tokens of a thought, for requests' thinking budgets
        (thinking_budget.py); None: reasoning is not configured."""
        if lora_slots is not None and decode_graph_sizes:
            raise ValueError("LoRA adapters run without decode graphs (models/lora_op.py)")
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}")
        self.logprobs_mode = logprobs_mode  # what logprobs report (--logprobs-mode)
        self.model = model
        # First, so that the KV pool is zeroed while the step compiles. Its dtype is the
        # model's unless given (an fp8 pool: runner/kv_memory.py).
        kv_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        self.kv_caches, self._kv_zeroing = allocate_kv_caches(
            model.config,
            num_blocks,
            block_size,
            kv_dtype,
            device,
            layer_kv_scales(model, kv_dtype),
            calculate_kv_scales,
        )
        self.model_step = ModelStep(
            model,
            compiled=compile_model,
            dtype=dtype,
            row_weight_dtype=row_weight_dtype,
            packed_weights=packed_weights,
        )
        self.device = device
        # The sampler's race compiled at warm-up (sampler_graphs.py), where the step is.
        self.race: CompiledRace | None = None
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        max_blocks_per_seq = -(-max_model_len // block_size)
        self.slots = SequenceSlots(max_num_seqs, max_blocks_per_seq, self.vocab_size)
        self.slot_tensors = SlotTensors(max_num_seqs, self.vocab_size, device)
        self.custom_logits = (
            CustomLogitsProcessors(logits_processors) if logits_processors else None
        )
        self.thinking = ThinkingBudgets(thinking_markers) if thinking_markers else None
        self.lora = None
        if lora_slots is not None:
            max_loras, max_rank, lora_dtype = lora_slots
            self.lora = LoRASlots(
                model, max_loras=max_loras, max_rank=max_rank, dtype=lora_dtype, device=device
            )
        # Decode steps padded to these batch sizes, from static buffers (decode_graphs.py).
        self.decode_graphs = None
        if decode_graph_sizes:
            self.decode_graphs = DecodeGraphs(
                self.model_step,
                self.kv_caches,
                sizes=decode_graph_sizes,
                max_seq_len=min(max_seq_len_to_capture or max_model_len, max_model_len),
                block_size=block_size,
                device=device,
            )

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The rows an image's `pixels` [3, H, W] give an image model's prompt, on the host
        (its vision tower and projector: LlavaForConditionalGeneration.image_features)."""
        with torch.inference_mode():
            features = self.model.image_features(pixels.to(self.device))
        return features.to("cpu")

    def warm_up(self) -> None:
        """Compile what the model step needs before the first request (see compiled_step.py)
        and capture the decode graphs; return once the KV pool is zeroed too."""
        self.model_step.warm_up(self.kv_caches, self.max_model_len)
        if self.device.type == "cpu" and self.model_step.compiled:
            self.race = compile_race(self.vocab_size)
        self._wait_for_kv_zeros()
        if self.decode_graphs is not None:
            self.decode_graphs.capture()
        if self.device.type != "cpu":
            self._warm_up_sampler()

    @torch.inference_mode()
    def _warm_up_sampler(self) -> None:
        """Compile the sampler's Triton kernels, which a GPU otherwise compiles on a
        request's first step: greedy and random rows with every mask, penalties, a bias and
        logprobs, at one row and at the most rows (the masks' two launch configurations)."""
        vocab = self.vocab_size
        for rows in sorted({1, self.max_num_seqs}):
            batch = make_sampling_batch(
                rows,
                device=self.device,
                temperature=[1.0] + [0.0] * (rows - 1),
                top_k=50,
                top_p=0.9,
                min_p=0.05,
                presence_penalty=0.5,
                repetition_penalty=1.1,
                output_token_counts=torch.zeros(rows, vocab, dtype=torch.int32, device=self.device),
                prompt_token_mask=torch.zeros(rows, vocab, dtype=torch.bool, device=self.device),
                logit_bias=[{0: 1.0}] * rows,
                num_logprobs=5,
                logprobs_mode=self.logprobs_mode,
            )
            sample(torch.randn(rows, vocab, device=self.device), batch)
        torch.cuda.synchronize(self.device)

    def _wait_for_kv_zeros(self) -> None:
        if self._kv_zeroing is not None:
            self._kv_zeroing.join()
            self._kv_zeroing = None

    # -- host, while earlier steps may still run -----------------------------------------------

    def prepare(self, plan: StepPlan) -> PreparedStep:
        custom, thinking = self.custom_logits, self.thinking
        for seq_id in plan.finished_seq_ids:
            self.slots.forget(seq_id)
            if thinking is not None:
                thinking.forget(seq_id)
            if self.lora is not None:
                self.lora.forget(seq_id)
            if custom is not None:
                custom.forget(seq_id)
        admissions = [self.slots.admit(seq) for seq in plan.new_sequences]
        for seq in plan.new_sequences:
            if custom is not None:
                custom.admit(seq)
            if thinking is not None:
                thinking.admit(seq)
        lora_loads = lora_token_slots = None
        if self.lora is not None:
            lora_loads = [load for seq in plan.new_sequences if (load := self.lora.admit(seq))]
            lora_token_slots = self.lora.token_slots(plan)
        drafts = draft_rows(plan.chunks)
        inputs, row_slots = build_host_inputs(
            plan,
            self.slots,
            self.block_size,
            self.device,
            # The graph of a one-row step works out its attention's reads itself; a step
            # with drafts has its attention planned once its chunks are split.
            plans_attention=drafts is None and not self.model_step.may_run_whole(plan),
        )
        sampled_rows = [row for row, chunk in enumerate(plan.chunks) if chunk.samples]
        prompt_logprobs = plan_prompt_logprobs(plan, self.slots, inputs.query_start_loc)
        if drafts is not None:
            inputs.logits_indices = expand_logits_indices(inputs.logits_indices, drafts)
            inputs = attend_drafts_as_decodes(inputs, plan.chunks, self.block_size, self.device)
        sampling = (
            build_host_sampling(self.slots, row_slots[sampled_rows], drafts)
            if sampled_rows
            else None
        )
        if self.decode_graphs is not None:
            inputs = self.decode_graphs.pad(inputs)
        sampled_seq_ids = [plan.chunks[row].seq_id for row in sampled_rows]
        thought_rows = None
        if thinking is not None and sampled_rows:
            first_rows = range(len(sampled_rows)) if drafts is None else drafts.first_rows.tolist()
            thought_rows = thinking.plan_rows(sampled_seq_ids, first_rows)
        return PreparedStep(
            admissions=admissions,
            inputs=inputs,
            sampling=sampling,
            sampled_seq_ids=sampled_seq_ids,
            num_tokens=plan.num_tokens,
            prompt_logprobs=prompt_logprobs,
            token_bitmask=plan.token_bitmask,
            lora_loads=lora_loads,
            lora_token_slots=lora_token_slots,
            processor_rows=custom.plan_rows(sampled_seq_ids) if custom and sampled_rows else None,
            thought_rows=thought_rows,
        )

    @property
    def graph_settings(self) -> CUDAGraphSettings:
        """--cudagraph-metrics' header: graphs replayed on CUDA and ROCm only."""
        graphs = self.decode_graphs
        if graphs is None:
            return CUDAGraphSettings()
        mode = "FULL_DECODE_ONLY" if self.device.type == "cuda" else "NONE"
        return CUDAGraphSettings(mode, tuple(graphs.sizes))

    def graph_stat(self, step: PreparedStep) -> CUDAGraphStat:
        """--cudagraph-metrics: how `step` runs (cudagraph_stats.py)."""
        size = step.inputs.graph_size
        if not size:
            return CUDAGraphStat.eager(step.num_tokens)
        return CUDAGraphStat.padded(step.num_tokens, size, size in self.decode_graphs.graphs)

    # -- the model thread, in step order ------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: PreparedStep) -> StepOutput:
        self._wait_for_kv_zeros()
        state = self.slot_tensors
        for admission in step.admissions:
            state.admit(admission)
        lora_groups = None
        if self.lora is not None:
            for load in step.lora_loads:
                self.lora.load(load)
            lora_groups = self.lora.groups(step.lora_token_slots)
        if step.inputs.graph_size:
            hidden, logits_indices = self.decode_graphs.run(step.inputs, state.last_sampled)
            logits = None
            if step.sampling is not None:
                logits = self.model_step.logits(hidden[logits_indices])
        else:
            inputs = step.inputs.to_device(self.device, state.last_sampled)
            with step_context(inputs.attention, self.kv_caches, lora_groups):
                hidden, logits = self.model_step.forward_and_logits(
                    inputs.input_ids, inputs.positions, inputs.logits_indices, inputs.embeds
                )
        prompt_logprobs = None
        if step.prompt_logprobs is not None:
            tensors = compute_prompt_logprobs(
                self.model_step, hidden, step.prompt_logprobs, self.device, self.logprobs_mode
            )
            if self.device.type != "cpu":
                tensors = _logprobs_to_host(tensors)
            prompt_logprobs = (step.prompt_logprobs, tensors)
        if step.sampling is None:
            output = StepOutput([], None, [], prompt_logprobs=prompt_logprobs)
            if self.device.type != "cpu":
                output.done = torch.cuda.Event()
                output.done.record()
            return output
        slots = host_to_device(step.sampling.slots, self.device)
        if step.token_bitmask is not None:
            step.token_bitmask.wait_ready()  # the engine fills it while the forward ran
        batch = step.sampling.to_batch(
            state, slots, self.device, step.token_bitmask, self.logprobs_mode
        )
        rows, thoughts = step.processor_rows, step.thought_rows
        processed = logits
        if rows is not None:
            processed = self.custom_logits.apply(rows, logits, batch.all_greedy)
        if thoughts is not None:
            processed = ThinkingBudgets.apply(thoughts, processed)
        if processed is logits:
            out = sample(logits, batch, self.race)
        else:
            out = sample(processed, batch, self.race, raw=logits)
        if rows is not None:
            self.custom_logits.record(rows, out.token_ids)
        if thoughts is not None:
            ThinkingBudgets.record(thoughts, out.token_ids)
        penalty_rows = step.sampling.penalty_rows
        if penalty_rows is not None:
            penalty_rows = host_to_device(penalty_rows, self.device)
        drafts = step.sampling.draft_rows
        kept = None
        if drafts is None:
            state.record_sampled(slots, out.token_ids, penalty_rows)
        else:
            kept = kept_rows(out.token_ids, drafts)
            record_kept(state, slots, out.token_ids, kept, drafts, penalty_rows)
        output = StepOutput(
            step.sampled_seq_ids,
            out,
            step.sampling.logprobs_wanted,
            prompt_logprobs=prompt_logprobs,
            chosen=chosen_logprobs(
                logits, step.sampling.chosen_ids, self.device, self.logprobs_mode, out.processed
            ),
        )
        out.processed = None  # [rows, vocab]: not kept past the step
        if drafts is not None:
            if self.device.type != "cpu":
                kept.num_kept = _pinned_copy(kept.num_kept)
            output.drafts = (drafts, kept, step.sampling.slots[drafts.first_rows])
        if self.device.type != "cpu":
            output.sampler = _to_host(out)
            if output.chosen is not None:
                output.chosen.logprobs = _pinned_copy(output.chosen.logprobs)
            output.done = torch.cuda.Event()
            output.done.record()
        return output

    # -- host, once the step's tokens are ready -------------------------------------------------

    def collect(self, output: StepOutput) -> StepResult:
        prompt_logprobs = {}
        if output.prompt_logprobs is not None:
            prompt_logprobs = collect_prompt_logprobs(*output.prompt_logprobs)
        if output.sampler is None:
            return StepResult({}, {}, prompt_logprobs)
        ids = output.sampled_seq_ids
        token_ids = output.sampler.token_ids.tolist()
        rows_of = None  # each sequence's rows, built for a step without drafts only if needed
        if output.drafts is None:
            sampled = {seq_id: [token] for seq_id, token in zip(ids, token_ids, strict=True)}
        else:
            rows_of = self._kept_rows(ids, *output.drafts)
            sampled = {
                seq_id: token_ids[rows.start : rows.stop] for seq_id, rows in rows_of.items()
            }
        logprobs: dict[str, list[TokenLogprobs]] = {}
        lp = output.sampler.logprobs
        if lp is not None:
            sampled_logprob = lp.sampled_logprob.tolist()
            sampled_rank = lp.sampled_rank.tolist()
            top_ids = lp.top_token_ids.tolist()
            top_values = lp.top_logprobs.tolist()
            chosen = output.chosen.by_row() if output.chosen is not None else {}
            if rows_of is None:
                rows_of = {seq_id: range(row, row + 1) for row, seq_id in enumerate(ids)}
            for seq_id, rows in rows_of.items():
                wanted = output.logprobs_wanted[rows.start]
                if wanted is None:
                    continue
                entries = logprobs[seq_id] = []
                for row in rows:
                    listed_ids, listed = top_ids[row][:wanted], top_values[row][:wanted]
                    if row in chosen:
                        listed_ids, listed = chosen[row]
                    entries.append(
                        TokenLogprobs(sampled_logprob[row], sampled_rank[row], listed_ids, listed)
                    )
        return StepResult(sampled, logprobs, prompt_logprobs)

    def _kept_rows(
        self, ids: list[str], rows: DraftRows, kept: KeptRows, chunk_slots: np.ndarray
    ) -> dict[str, range]:
        """Each sampling sequence's kept rows; their tokens count as sampled (the step
        counted one a sequence when it was prepared)."""
        num_kept = kept.num_kept.tolist()
        self.slots.num_sampled[chunk_slots] += np.asarray(num_kept, dtype=np.int64) - 1
        return {
            seq_id: range(first, first + n)
            for seq_id, first, n in zip(ids, rows.first_rows.tolist(), num_kept, strict=True)
        }


@dataclass
class ChosenLogprobs:
    """The logprobs of the tokens some rows chose (logprob_token_ids)."""

    token_ids: dict[int, tuple[int, ...]]  # row -> its chosen tokens
    logprobs: torch.Tensor  # [rows in token_ids' order, most chosen] float32

    def by_row(self) -> dict[int, tuple[list[int], list[float]]]:
        """row -> (its chosen tokens, their logprobs), on the host."""
        values = self.logprobs.tolist()
        return {
            row: (list(ids), values[i][: len(ids)])
            for i, (row, ids) in enumerate(self.token_ids.items())
        }


def chosen_logprobs(
    logits: torch.Tensor,
    chosen_ids: dict[int, tuple[int, ...]],
    device: torch.device,
    logprobs_mode: str = "raw_logprobs",
    processed: torch.Tensor | None = None,
) -> ChosenLogprobs | None:
    """The values of the tokens each row of `chosen_ids` chose, in the logprobs mode as the
    sampler's own (vLLM's too): the float32 log-softmax of the raw `logits` by default, the
    logits themselves, or the same of the `processed` logits the sampler returned in the
    processed modes. One pass over those rows, one gather."""
    if not chosen_ids:
        return None
    if logprobs_mode.startswith("processed_"):
        assert processed is not None, "the sampler returns the processed logits in this mode"
        logits = processed
    width = max(len(ids) for ids in chosen_ids.values())
    index = np.zeros((len(chosen_ids), width), dtype=np.int64)  # padding reads token 0
    for i, ids in enumerate(chosen_ids.values()):
        index[i, : len(ids)] = ids
    rows = host_to_device(np.fromiter(chosen_ids, dtype=np.int64), device)
    logprobs = logits[rows].float()
    if logprobs_mode.endswith("_logprobs"):
        logprobs = torch.log_softmax(logprobs, dim=-1)
    return ChosenLogprobs(chosen_ids, logprobs.gather(1, host_to_device(index, device)))


def _to_host(out: SamplerOutput) -> SamplerOutput:
    """The sampler's output copied to pinned host memory, asynchronously."""
    lp = _logprobs_to_host(out.logprobs) if out.logprobs is not None else None
    return SamplerOutput(_pinned_copy(out.token_ids), lp)


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(
        _pinned_copy(lp.sampled_logprob),
        _pinned_copy(lp.sampled_rank),
        _pinned_copy(lp.top_token_ids),
        _pinned_copy(lp.top_logprobs),
    )


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
