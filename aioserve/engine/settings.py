"""What an engine runs with once its configuration is resolved (build.py): its settings, and
the parts the AsyncEngine is made of."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from aioserve.config.kv_events import KVEventsSettings
from aioserve.config.speculative import NgramSpeculation
from aioserve.engine.load_report import LoadReport
from aioserve.engine.partial_prefills import PartialPrefillLimits
from aioserve.engine.scheduler_limits import SchedulerLimits
from aioserve.engine.step_observation import ObservabilitySettings
from aioserve.engine.structured_outputs.params import StructuredOutputsConfig
from aioserve.runner.model_runner import ModelRunner

if TYPE_CHECKING:
    from torch import nn

    from aioserve.engine.lora_requests import LoRAAdapterCache
    from aioserve.models.image_inputs import ImageProcessor
    from aioserve.models.pooler import PoolerConfig
    from aioserve.runner.pooling_runner import PoolingRunner


@dataclass
class EngineSettings:
    """Every value the engine runs with, after resolution."""

    model_name: str
    served_model_names: list[str]
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    scheduling_policy: str
    async_scheduling: bool
    max_logprobs: int
    seed: int
    eos_token_ids: frozenset[int]
    """Every token id that ends a request as its end of sequence (tokenizer, generation
    config and model config); the tokenizer's own is `tokenizer_eos_token_id`."""
    default_sampling: dict
    """Defaults from the generation config (auto / folder) plus --override-generation-config."""
    max_new_tokens_cap: int | None
    max_num_queued_reqs: int | None = None
    """--max-num-queued-reqs: most sequences in flight; more are refused (load_shedding.py)."""
    max_num_queued_tokens: int | None = None
    """--max-num-queued-tokens: the prefill backlog at which requests are refused."""
    long_prefill_token_threshold: int = 0
    """--long-prefill-token-threshold: most tokens of one sequence a step (scheduler.py)."""
    partial_prefills: PartialPrefillLimits | None = None
    """--max-num-partial-prefills and --max-long-partial-prefills, with the long-prompt
    threshold resolved (partial_prefills.py); None: one partial prefill at a time."""
    enable_prompt_embeds: bool = False
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)  # --limit-mm-per-prompt
    allowed_local_media_path: str = ""  # where chat requests may read file:// images
    """--enable-prompt-embeds: prompts may come as embeddings (prompt_embeds.py)."""
    enable_sleep_mode: bool = False
    """--enable-sleep-mode: sleeping frees the KV cache and the weights (engine/sleep.py)."""
    hidden_size: int = 0
    """The model's hidden size: the width of a prompt's embeddings."""
    prefix_caching_hash_algo: str = "sha256"
    """--prefix-caching-hash-algo: how full blocks are keyed (block_hashing.py)."""
    kv_events: KVEventsSettings | None = None
    """--kv-events-config: the KV-cache events published for routers (kv_events.py)."""
    reasoning_parser: str = ""
    """--reasoning-parser: how chat answers split into reasoning and content ("": none)."""
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    """The structured-output defaults (--structured-outputs-config, --guided-decoding-*)."""
    load_report: LoadReport | None = None
    """What was loaded and the memory it holds (load_report.py); None around a stand-in runner."""
    tokenizer_eos_token_id: int | None = None
    """The tokenizer's EOS: the one that ends a request with no stop_reason (vLLM's)."""
    pooler: PoolerConfig | None = None
    """A pooling model's pooler (pooling_build.py); None for a generative model."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """A pooling model's allowed `dimensions` (() any); None: not a matryoshka model."""
    pooled_size: int = 0
    """A pooling model's vector length (its hidden size)."""
    max_loras: int = 0
    """--max-loras with --enable-lora: most adapters a step runs; 0: LoRA is off."""
    speculation: NgramSpeculation | None = None
    """--speculative-config: how decodes draft tokens (speculation.py); None: they do not."""
    scheduler_delay_factor: float = 0.0
    """--scheduler-delay-factor: prompts held back while requests run (prompt_delay.py)."""
    scheduler_limits: SchedulerLimits = SchedulerLimits()
    """--max-num-scheduled-tokens, --max-num-active-seqs, --watermark,
    --scheduler-reserve-full-isl, --long-prefill-token-threshold-adaptive
    (scheduler_limits.py); the defaults are vLLM's."""
    collect_model_forward_time: bool = False
    """--collect-detailed-traces model (or all): steps' forward times (step_timing.py)."""
    collect_model_execute_time: bool = False
    """--collect-detailed-traces worker (or all): steps' execute times (step_timing.py)."""
    logits_processor_classes: tuple[type, ...] = ()
    """--logits-processors: their classes, which check each request's parameters."""
    stream_interval: int = 1
    """--stream-interval: tokens a streamed answer gathers before it sends a chunk."""
    observability: ObservabilitySettings = ObservabilitySettings()
    """--kv-cache-metrics, --enable-mfu-metrics, --enable-logging-iteration-details
    (step_observation.py); all off by default."""
    thinking_budgets: bool = False
    """Whether requests may set thinking_token_budget: reasoning is configured, with
    markers (--reasoning-parser, --reasoning-config; engine/thinking_markers.py)."""

    @property
    def runner_type(self) -> str:
        """vLLM's runner type: "pooling" or "generate"."""
        return "generate" if self.pooler is None else "pooling"


@dataclass
class EngineParts:
    settings: EngineSettings
    tokenizer: PreTrainedTokenizerBase | None
    runner: ModelRunner | PoolingRunner
    hf_config: object
    lora_adapters: LoRAAdapterCache | None = None
    """The adapters read so far, with --enable-lora (lora_requests.py)."""
    load_weights: Callable[[], nn.Module] | None = None
    """Loads the served model again from its checkpoint (a level-2 wake: engine/sleep.py)."""
    image_processor: ImageProcessor | None = None
    """An image model's processor (models/image_inputs.py); None: the model takes no images."""
