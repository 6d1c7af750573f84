"""Assemble the engine of a pooling model: an encoder-only model (BERT) served for its vectors.

`build_engine` (build.py) comes here once the checkpoint is open and `serves_pooling` says
the model is a pooling one: --runner pooling (or --task embed), or --runner auto with an
encoder-only architecture (models/registry.py). What differs from a generative model:

- the pooler (models/pooler.py): the sentence-transformers files' pooling and
  normalization (modules.json, 1_Pooling/config.json), else vLLM's default for the
  architecture, then --override-pooler-config's keys;
- max_model_len: the model's positions, capped by sentence-transformers' `max_seq_length`
  (sentence_bert_config.json, or its RoBERTa, XLM-R ... sibling), as vLLM caps it; never
  past the learned position table, even under VLLM_ALLOW_LONG_MAX_MODEL_LEN;
- no chunked prefill and no prefix caching: an encoder attends to the whole prompt at
  once, so a prompt runs whole in one step, and the token budget is at least
  max_model_len;
- no KV cache: the scheduler still counts blocks (it admits by them), but they are
  bookkeeping only, as many as two steps of whole prompts can hold; the runner keeps no
  memory for them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from aioserve.config.engine import EngineConfig, ModelConfig
from aioserve.config.values import AUTO_FIT
from aioserve.engine.load_report import build_load_report
from aioserve.engine.resolution import (
    LONG_MAX_MODEL_LEN_ENV,
    batch_default,
    check_long_max_model_len,
    resolve_async_scheduling,
    resolve_dtype,
    resolve_max_model_len,
    resolve_packed_weights,
)
from aioserve.engine.scheduler_limits import resolve_scheduler_limits
from aioserve.engine.served_weights import load_served_model
from aioserve.engine.settings import EngineParts, EngineSettings
from aioserve.engine.step_observation import engine_observability
from aioserve.models.checkpoint import Checkpoint
from aioserve.models.linear import pack_weights
from aioserve.models.pooler import PoolerConfig, pooler_config_for, sentence_transformers_pooling
from aioserve.models.registry import is_pooling_architecture, model_class_for
from aioserve.platform import current_platform, device
from aioserve.runner.decoder_pooling import DecoderAsEncoder
from aioserve.runner.pooling_runner import PoolingRunner

logger = logging.getLogger("aioserve")

BOOKKEEPING_BLOCK_SIZE = 16
"""The block size the scheduler counts a pooling model's prompts in (no memory behind it)."""


def serves_pooling(model_cfg: ModelConfig, checkpoint: Checkpoint) -> bool:
    """Whether the model is served by the pooling runner: --runner (or the deprecated
    --task) as given, else the architecture's, as vLLM 0.32 decides: an encoder pools, and
    so does a generative model converted to embeddings (--convert embed, or --runner
    pooling, or a sentence-transformers folder's Pooling module, which Qwen3-Embedding has
    on its Qwen3ForCausalLM). ValueError for a runner the model cannot have."""
    hf_config = checkpoint.hf_config
    encoder = is_pooling_architecture(hf_config)
    if encoder and model_cfg.model_impl == "transformers":
        raise ValueError(
            "--model-impl transformers: aioserve's Transformers backend serves causal "
            "language models only, not a pooling model yet"
        )
    runner = model_cfg.runner
    from_task = {"embed": "pooling", "embedding": "pooling", "generate": "generate"}.get(
        model_cfg.task, "auto"
    )
    if runner == "auto":
        runner = from_task
    elif from_task not in ("auto", runner):
        raise ValueError(f"--task {model_cfg.task} contradicts --runner {model_cfg.runner}")
    convert = model_cfg.convert
    architectures = ", ".join(getattr(hf_config, "architectures", None) or ["unknown"])
    if runner == "generate" and (encoder or convert == "embed"):
        what = "an encoder-only model" if encoder else "converted to embeddings (--convert embed)"
        raise ValueError(
            f"--runner generate: {architectures} is {what}, which cannot generate text; "
            "serve it with --runner pooling (or auto)"
        )
    if runner == "auto" and not encoder:
        folder = Path(checkpoint.source.path) if checkpoint.source.kind == "hf_folder" else None
        st_pooling = folder is not None and sentence_transformers_pooling(folder) is not None
        runner = "pooling" if convert == "embed" or st_pooling else "generate"
    if runner == "pooling" and not encoder and convert == "none":
        raise ValueError(
            f"--runner pooling: {architectures} is a generative model; --convert none keeps "
            "it one (--convert embed serves it as an embedding model)"
        )
    return encoder or runner == "pooling"


# sentence-transformers' settings file of each encoder family, in vLLM's order.
_SENTENCE_CONFIG_FILES = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)


def sentence_transformers_max_len(checkpoint: Checkpoint) -> int | None:
    """`max_seq_length` of a folder's sentence-transformers settings (the first of
    sentence_bert_config.json, sentence_roberta_config.json, ... it has), if any."""
    if checkpoint.source.kind != "hf_folder":
        return None
    for name in _SENTENCE_CONFIG_FILES:
        path = Path(checkpoint.source.path) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("max_seq_length")
            return int(value) if isinstance(value, int) and value > 0 else None
    return None


def resolve_pooling_max_model_len(model_cfg: ModelConfig, checkpoint: Checkpoint) -> int:
    """The model's positions (RoBERTa's less their offset), capped by sentence-transformers'
    max_seq_length; a larger --max-model-len is refused, as vLLM refuses it, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN allows it, and never past the position table."""
    hf_config = checkpoint.hf_config
    derived = resolve_max_model_len(None, hf_config)
    # An encoder's learned position table; a decoder's rotary positions have none.
    max_prompt_len = getattr(model_class_for(hf_config, "auto"), "max_prompt_len", None)
    table = derived if max_prompt_len is None else max_prompt_len(hf_config)
    derived = min(derived, table)
    capped = sentence_transformers_max_len(checkpoint)
    if capped is not None:
        derived = min(derived, capped)
    requested = model_cfg.max_model_len
    if requested is None or requested == AUTO_FIT:  # no KV cache to fit in
        return derived
    if requested > table:
        # vLLM lets it through under VLLM_ALLOW_LONG_MAX_MODEL_LEN, then indexes past the
        # table on the first long prompt.
        raise ValueError(
            f"--max-model-len {requested} is larger than the model's maximum context length "
            f"{derived}: its position embeddings are a learned table of {table} positions, "
            f"which no setting extends (not even {LONG_MAX_MODEL_LEN_ENV}=1)"
        )
    if requested > derived:
        check_long_max_model_len(requested, derived)
    return requested


def matryoshka_dimensions(hf_config) -> tuple[int, ...] | None:
    """The `dimensions` a matryoshka model accepts (() any), from its config as vLLM reads
    it (`is_matryoshka`, `matryoshka_dimensions`); None for other models."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return tuple(int(d) for d in dimensions)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def describe_pooler(pooler: PoolerConfig) -> str:
    """The pooler in words, for the ready log line."""
    if pooler.task == "classify":
        return f"a sequence classifier: {pooler.num_labels} label(s), {pooler.activation}"
    return f"{pooler.pooling_type} pooling{', normalized' if pooler.normalize else ''}"


def build_pooling_engine(config: EngineConfig, checkpoint: Checkpoint, tokenizer) -> EngineParts:
    model_cfg, sched_cfg = config.model, config.scheduler
    if checkpoint.load_format == "gguf" or checkpoint.int4_scheme or checkpoint.fp8_scheme:
        raise ValueError(
            "a pooling model loads from a 16- or 32-bit folder; quantized pooling models are "
            "not supported by aioserve yet"
        )
    if checkpoint.int8_scheme or checkpoint.quantize_to_fp8:
        raise ValueError("a pooling model cannot be quantized by aioserve yet (--quantization)")
    events = config.cache.kv_events_config
    if events is not None and events.enable_kv_cache_events:
        raise ValueError(
            "--kv-events-config: a pooling model has no prefix cache, so no KV-cache events"
        )
    hf_config = checkpoint.hf_config
    platform = current_platform()
    dtype = resolve_dtype(model_cfg.dtype, checkpoint)
    dev = device()
    max_model_len = resolve_pooling_max_model_len(model_cfg, checkpoint)
    mode = config.compilation.performance_mode
    max_tokens = sched_cfg.max_num_batched_tokens
    if max_tokens is None:
        max_tokens = max(
            batch_default("max_num_batched_tokens", platform, config.serving, mode),
            max_model_len,
        )
    elif max_tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens ({max_tokens}) is smaller than --max-model-len "
            f"({max_model_len}): a pooling model runs each prompt whole in one step"
        )
    max_num_seqs = sched_cfg.max_num_seqs or batch_default(
        "max_num_seqs", platform, config.serving, mode
    )
    # A pooling model runs each prompt whole: as without chunked prefill.
    scheduler_limits = resolve_scheduler_limits(
        sched_cfg, max_tokens, max_num_seqs, max_model_len, chunked_prefill=False
    )
    folder = Path(checkpoint.source.path) if checkpoint.source.kind == "hf_folder" else None
    pooler = pooler_config_for(folder, hf_config, model_cfg.override_pooler_config)

    model = load_served_model(checkpoint, config, dtype, dev)
    if resolve_packed_weights(dtype):
        pack_weights(model)
        logger.info("dense products run oneDNN on its packed layout of the weights")
    if not is_pooling_architecture(hf_config):
        logger.info("%s converted to an embedding model (--convert embed)", type(model).__name__)
        model = DecoderAsEncoder(
            model,
            max_num_batched_tokens=max_tokens,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            device=dev,
        )
    runner = PoolingRunner(
        model,
        pooling_type=pooler.pooling_type,
        classify=pooler.task == "classify",
        max_num_batched_tokens=max_tokens,
        max_model_len=max_model_len,
        device=dev,
    )
    runner.warm_up()
    block_size = BOOKKEEPING_BLOCK_SIZE
    num_blocks = 2 * (-(-max_tokens // block_size) + max_num_seqs)  # two steps in flight
    served = model_cfg.served_model_name or [model_cfg.model]
    settings = EngineSettings(
        observability=engine_observability(config, checkpoint, dtype, dtype, runner.graph_settings),
        model_name=model_cfg.model,
        served_model_names=list(served),
        dtype=dtype,
        device=dev,
        max_model_len=max_model_len,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_tokens,
        enable_chunked_prefill=False,
        enable_prefix_caching=False,
        scheduling_policy=sched_cfg.scheduling_policy,
        async_scheduling=resolve_async_scheduling(sched_cfg.async_scheduling, platform),
        max_logprobs=model_cfg.max_logprobs,
        seed=model_cfg.seed,
        eos_token_ids=frozenset(),
        default_sampling={},
        max_new_tokens_cap=None,
        max_num_queued_reqs=sched_cfg.max_num_queued_reqs,
        max_num_queued_tokens=sched_cfg.max_num_queued_tokens,
        scheduler_delay_factor=sched_cfg.scheduler_delay_factor,
        scheduler_limits=scheduler_limits,
        collect_model_forward_time=config.observability.collect_model_forward_time,
        collect_model_execute_time=config.observability.collect_model_execute_time,
        pooler=pooler,
        matryoshka_dimensions=matryoshka_dimensions(hf_config),
        pooled_size=hf_config.hidden_size,
        load_report=build_load_report(model_cfg.model, checkpoint, runner, ""),
    )
    logger.info(
        "engine ready: %s, a pooling model (%s), %s on %s, max_model_len %d, "
        "up to %d prompts and %d tokens a step",
        model_cfg.model,
        describe_pooler(pooler),
        str(dtype).removeprefix("torch."),
        dev,
        max_model_len,
        max_num_seqs,
        max_tokens,
    )
    return EngineParts(settings=settings, tokenizer=tokenizer, runner=runner, hf_config=hf_config)
