"""Every `vllm serve` argument, declared once: name, group, default, help, spelling, checks.

Each argument of vLLM's serving surface is one `Argument` below (the HTTP server's, vLLM's
Frontend group, in frontend_arguments.py, first in ARGUMENTS), in vLLM's config groups,
with its real default: a value, None where the model decides (max_model_len, quantization)
or a `PlatformDefault` where the device does. The arguments aioserve implements carry the
function that checks and converts their value; the others are declared so that the parser
knows them and aioserve can refuse them by name. `parser.py` turns these declarations into
argparse options and `--help`; `engine.py` and `frontend.py` into the configuration objects.
"""

from __future__ import annotations

from aioserve.config import multimodal, values
from aioserve.config.compilation import CompilationSettings, compilation_config
from aioserve.config.declaration import (
    CACHE,
    DECODING,
    DEVICE,
    LOAD,
    LORA,
    MODEL,
    MULTIMODAL,
    PROMPT_ADAPTER,
    SCHEDULER,
    SPECULATIVE,
    TOKENIZER_POOL,
    VLLM,
    Argument,
    PlatformDefault,
    vllm_only,
)
from aioserve.config.frontend_arguments import FRONTEND_ARGUMENTS
from aioserve.config.hub_arguments import HUB_ARGUMENTS
from aioserve.config.kv_events import kv_events_settings
from aioserve.config.observability_arguments import OBSERVABILITY_ARGUMENTS
from aioserve.config.optimization import OPTIMIZATION_ARGUMENTS
from aioserve.config.parallel_arguments import PARALLEL_ARGUMENTS
from aioserve.config.reasoning_names import REASONING_PARSERS, VLLM_OTHER_REASONING_PARSERS
from aioserve.config.recent_arguments import RECENT_ARGUMENTS
from aioserve.config.scheduler_arguments import SCHEDULER_032_ARGUMENTS
from aioserve.config.speculative import spec_model, speculative_settings

# The model served when none is given. It must equal aioserve.models.resolve.DEFAULT_MODEL
# (a test checks); it is repeated here so that `--help` does not import the model code.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0


_STRUCTURED_OUTPUT_BACKENDS = ("auto", "outlines", "guidance", "xgrammar")
_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# fmt: off
_VLLM_QUANTIZATIONS = (
    "aqlm", "auto-round", "bitblas", "bitsandbytes", "deepspeedfp",
    "experts_int8", "fbgemm_fp8", "gptq_bitblas", "gptq_marlin_24", "hqq", "ipex",
    "marlin", "modelopt", "modelopt_fp4", "moe_wna16",
    "neuron_quant", "nvfp4", "ptpc_fp8", "qqq", "quark", "torchao", "tpu_int8",
)
_VLLM_LOAD_FORMATS = (
    "npcache", "tensorizer", "sharded_state", "bitsandbytes", "mistral", "runai_streamer",
    "runai_streamer_sharded", "fastsafetensors",
)
_VLLM_SPEC_METHODS = (
    "bailing_hybrid_mtp", "bailing_hybrid_v3_mtp", "custom_class", "deepseek_mtp", "dflash",
    "dots3_note_mtp", "draft_model", "dspark", "eagle", "eagle3", "ernie_mtp",
    "exaone4_5_mtp", "exaone_moe_mtp", "extract_hidden_states", "gemma4_mtp",
    "glm4_moe_lite_mtp", "glm4_moe_mtp", "glm5_next_mtp", "glm_ocr_mtp", "hy_v3_mtp",
    "hy_v4_mtp", "inkling_mtp", "kimi_k3_mtp", "longcat_flash_mtp", "medusa", "mimo_mtp",
    "mimo_v2_mtp", "minimax_m3_mtp", "mlp_speculator", "mtp", "nemotron_h_mtp", "ngram_gpu",
    "pangu_ultra_moe_mtp", "qwen3_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "step3p5_mtp",
    "suffix",
)  # vLLM 0.32's other --spec-method choices
# fmt: on

# fmt: off
ARGUMENTS: tuple[Argument, ...] = (
    *FRONTEND_ARGUMENTS,
    # --- ModelConfig -----------------------------------------------------------------------
    Argument("model", MODEL, DEFAULT_MODEL,
             "Hugging Face model id, local folder or .gguf file to serve; also the name in "
             "metrics when --served-model-name is not given.", convert=values.string),
    Argument("runner", MODEL, "auto",
             "Which runner serves the model: generate (text generation) or pooling (an "
             "encoder-only embedding model such as BERT, served on /v1/embeddings, /pooling, "
             "/score and /rerank). auto picks it from the model's architecture.",
             convert=values.string, choices=("auto", "generate", "pooling"),
             vllm_choices=("draft",), choice_noun="runner"),
    Argument("convert", MODEL, "auto",
             "Adapt a model to a pooling task. embed: a generative model serves embeddings "
             "(its last row's hidden state, normalized, unless its sentence-transformers "
             "files or --pooler-config say otherwise); auto: so with --runner pooling or a "
             "sentence-transformers Pooling module, else as it is; none: as it is.",
             convert=values.string, choices=("auto", "none", "embed"),
             vllm_choices=("classify", "reward"), choice_noun="conversion"),
    Argument("task", MODEL, "auto",
             "Deprecated in vLLM (use --runner): generate, or embed / embedding for the "
             "pooling runner.",
             convert=values.string, choices=("auto", "generate", "embed", "embedding"),
             vllm_choices=("classify", "score", "reward", "transcription", "draft"),
             choice_noun="task"),
    Argument("tokenizer", MODEL, None, "Tokenizer id or folder, when it differs from the model.",
             convert=values.string),
    Argument("tokenizer-mode", MODEL, "auto",
             "auto uses the fast tokenizer when there is one; slow always uses the slow one.",
             convert=values.string, choices=("auto", "slow"), vllm_choices=("mistral", "custom"),
             choice_noun="tokenizer mode"),
    Argument("trust-remote-code", MODEL, False,
             "Accepted for compatibility. aioserve never runs code shipped with a model: it "
             "implements each architecture itself.", "bool", convert=values.boolean),
    Argument("dtype", MODEL, "auto",
             "Precision of weights and activations; half = float16, float = float32. auto: on "
             "a GPU the checkpoint's (bfloat16 or float16; float32 models run in float16), on "
             "the CPU bfloat16 where the CPU computes it in hardware (AMX or AVX-512-BF16), "
             "else float32.",
             convert=values.string, choices=_DTYPES),
    Argument("seed", MODEL, 0, "Random seed for sampling.", convert=values.integer),
    Argument("hf-config-path", MODEL, None,
             "Read the model's HF config (config.json) from this folder or id instead of the "
             "model's own; a GGUF file's metadata then gives only its weights.",
             convert=values.string),
    Argument("allowed-local-media-path", MODEL, "",
             "Folder from which chat requests may read local images (file:// URLs); a "
             "security risk: only in trusted environments.", convert=multimodal.media_folder),
    *HUB_ARGUMENTS,
    Argument("rope-scaling", MODEL, {},
             "Replace the model's RoPE scaling (JSON object), e.g. "
             "{\"rope_type\":\"yarn\",\"factor\":4.0,\"original_max_position_embeddings\":32768}. "
             "Types: linear, dynamic (fixed at the longest context its factor allows), llama3, "
             "yarn, longrope. linear and dynamic stretch the model's context by their factor; "
             "YaRN's context is its original_max_position_embeddings times its factor (or the "
             "model's max_position_embeddings, if longer); longrope takes its long factors "
             "when --max-model-len passes its original_max_position_embeddings.",
             "json", convert=values.json_object),
    Argument("rope-theta", MODEL, None,
             "Replace the model's RoPE base frequency; use with --rope-scaling.",
             convert=values.positive_number),
    Argument("max-model-len", MODEL, None,
             "Longest context (prompt plus output), in tokens; k/m/g multiply by powers of 10 "
             "and K/M/G by powers of 2 (1k = 1000, 1K = 1024, 25.6k = 25600); -1 or auto: the "
             "model's own limit cut to what the KV cache holds. Default: the model's own limit.",
             convert=values.context_length),
    Argument("quantization", MODEL, None,
             "Weight quantization method. Default: read from the model (a .gguf file means "
             "gguf, a folder's quantization_config awq or gptq (4 bits), fp8 or "
             "compressed-tensors (FP8 W8A8 only)); when given it must match the model. "
             "awq_marlin and gptq_marlin (vLLM's faster kernels for the same weights) are "
             "accepted as awq and gptq. fp8 on a 16-bit model quantizes its decoder layers at "
             "load (a GPU only: the CPU has no FP8 kernels). vLLM's other methods are refused "
             "by name.",
             convert=values.string,
             choices=("gguf", "awq", "awq_marlin", "gptq", "gptq_marlin", "fp8",
                      "compressed-tensors"),
             vllm_choices=_VLLM_QUANTIZATIONS,
             choice_noun="quantization method", aliases=("-q",)),
    Argument("enforce-eager", MODEL, False,
             "Run every step eagerly: no torch.compile of the model step on the CPU (which "
             "costs start-up time, once per process), no CUDA/HIP graphs (less memory, "
             "slower).", "bool",
             convert=values.boolean),
    Argument("max-seq-len-to-capture", MODEL, 8192,
             "Longest context a decode step replayed from a CUDA/HIP graph may have; longer "
             "ones run eagerly. Capped by --max-model-len.",
             convert=values.integer_at_least(1)),
    Argument("max-logprobs", MODEL, 20,
             "Most log probabilities a request may ask for; -1 means no limit.",
             convert=values.integer_at_least(-1)),
    Argument("logprobs-mode", MODEL, "raw_logprobs",
             "What logprobs report: the log-softmax (*_logprobs) or the float32 logits "
             "themselves (*_logits), before any processing (raw_*) or as sampling saw them "
             "(processed_*: after logit bias, bans and penalties, then temperature and the "
             "min-p, top-k and top-p masks, dropped tokens at -inf). Prompt logprobs are "
             "never processed.",
             convert=values.string,
             choices=("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")),
    Argument("disable-sliding-window", MODEL, False,
             "Attend over the whole context of a model trained with a sliding window, and "
             "cap the context at the window.", "bool",
             convert=values.boolean),
    Argument("disable-cascade-attn", MODEL, True,
             "Turn cascade attention off (vLLM 0.32's default). aioserve has no cascade "
             "attention: true is accepted, false (--no-disable-cascade-attn) refused.",
             "bool", convert=values.cascade_attention_off),
    Argument("skip-tokenizer-init", MODEL, False,
             "Load no tokenizer: requests must send token ids and get token ids back.", "bool",
             convert=values.boolean),
    Argument("enable-prompt-embeds", MODEL, False,
             "Accept prompts as embeddings: /v1/completions' prompt_embeds (a base64 torch.save "
             "of a [tokens, hidden size] tensor), the offline API's {\"prompt_embeds\": tensor}.",
             "bool", convert=values.boolean),
    Argument("served-model-name", MODEL, None,
             "Name(s) the API answers to; the first one appears in responses and metrics. "
             "Default: the --model value.", "list", convert=values.names),
    vllm_only("disable-async-output-proc", MODEL, False,
          "Do not overlap output processing with the model step.", "flag"),
    vllm_only("config-format", MODEL, "auto", "Format of the model config.", choices=("auto", "hf", "mistral")),
    Argument("hf-overrides", MODEL, {}, "Keys forced into the model's HF config (JSON object).",
             "json", convert=values.json_object),
    vllm_only("override-neuron-config", MODEL, {}, "Overrides for AWS Neuron devices.", "json"),
    Argument("override-pooler-config", MODEL, {},
             "Override a pooling model's pooler (JSON object): pooling_type (MEAN, CLS or "
             "LAST) and use_activation (true/false: L2-normalize embeddings). Default: the model's sentence-transformers "
             "files (modules.json, 1_Pooling), else CLS with normalization. "
             "--pooler-config is vLLM 0.32's name for it.",
             "json", convert=values.json_object, aliases=("--pooler-config",)),
    vllm_only("logits-processor-pattern", MODEL, None,
          "Regex of the logits-processor names that requests may use."),
    Argument("logits-processors", MODEL, None,
             "Custom logits processors, each a class named module.path:ClassName, built at "
             "start and run on every step's logits before aioserve's own sampling settings "
             "(the interface: aioserve.logits_processor, vLLM v1's). A request passes them "
             "arguments in vllm_xargs (SamplingParams.extra_args).",
             "list", convert=values.logits_processors),
    Argument("generation-config", MODEL, "auto",
             "Default sampling settings: auto reads the model's generation_config.json, vllm "
             "uses built-in defaults, a folder path reads that folder's file. A max_new_tokens "
             "there caps every request.", convert=values.generation_config),
    Argument("override-generation-config", MODEL, {},
             "Sampling defaults to add or override (JSON object), e.g. {\"temperature\": 0.5}.",
             "json", convert=values.json_object),
    Argument("enable-sleep-mode", MODEL, False,
             "Let the engine sleep and wake (VLLM_SERVER_DEV_MODE=1's /sleep, /wake_up, "
             "/is_sleeping and /release_kv_cache_memory; LLM.sleep and LLM.wake_up): asleep, "
             "it frees the KV cache's memory and offloads (level 1) or discards (level 2) the "
             "weights. Without it sleeping only pauses, as in vLLM, and frees nothing.",
             "bool", convert=values.boolean),
    Argument("model-impl", MODEL, "auto", "auto: aioserve's own model code where it has it, "
             "else Transformers' with aioserve's paged attention (eager); vllm: aioserve's own "
             "only; transformers: Transformers' always.", convert=values.string,
             choices=("auto", "vllm", "transformers"), vllm_choices=("terratorch",), choice_noun="model implementation"),
    vllm_only("override-attention-dtype", MODEL, None, "Run attention in another dtype."),
    vllm_only("quantization-param-path", MODEL, None, "JSON file of FP8 KV-cache scales."),
    # --- LoadConfig ------------------------------------------------------------------------
    Argument("load-format", LOAD, "auto",
             "Weight format: auto tries safetensors, then PyTorch .bin files (and a .gguf path "
             "means gguf); dummy uses random weights, for benchmarks.",
             convert=values.string, choices=("auto", "safetensors", "pt", "gguf", "dummy"),
             vllm_choices=_VLLM_LOAD_FORMATS, choice_noun="load format"),
    Argument("download-dir", LOAD, None,
             "Folder to download weights to and load them from. Default: the HF cache.",
             convert=values.string),
    vllm_only("model-loader-extra-config", LOAD, {}, "Options for the weight loader.", "json"),
    Argument("ignore-patterns", LOAD, ["original/**/*"],
             "Skip the weight files (safetensors, .bin, .pt) whose path in the model's folder "
             "matches one of these globs, as huggingface_hub matches them (* also matches /; "
             "a pattern ending in / stands for that folder); a hub model's skipped files are "
             "not downloaded. With --load-format auto, a folder whose safetensors are all "
             "skipped loads its PyTorch weights. \"\" skips nothing.",
             "list", convert=values.glob_patterns),
    Argument("use-tqdm-on-load", LOAD, True,
             "Show a progress bar while the weights load (on a terminal; a log gets one line).",
             "bool", convert=values.boolean),
    Argument("pt-load-map-location", LOAD, "cpu",
             "Where PyTorch (.bin, .pt) weights are loaded, as torch.load's map_location: "
             "cpu, cuda, cuda:N, or a JSON object from the device a tensor was saved on to "
             "one of those, e.g. {\"cuda:1\": \"cuda:0\"}. Safetensors and GGUF weights "
             "do not use it.", convert=values.map_location),
    vllm_only("qlora-adapter-name-or-path", LOAD, None, "Deprecated in vLLM; has no effect."),
    # --- DecodingConfig --------------------------------------------------------------------
    Argument("guided-decoding-backend", DECODING, "auto",
             "Default structured-output backend: auto (outlines where it enforces the whole "
             "constraint, else guidance; xgrammar for structural tags), outlines, guidance "
             "(llguidance) or xgrammar. A request may pick its own "
             "(guided_decoding_backend).", convert=values.string,
             choices=_STRUCTURED_OUTPUT_BACKENDS, vllm_choices=("lm-format-enforcer",),
             choice_noun="structured-output backend"),
    Argument("guided-decoding-disable-fallback", DECODING, False,
             "With backend auto, refuse a constraint outlines cannot compile rather than "
             "hand it to guidance.", "bool", convert=values.boolean),
    Argument("guided-decoding-disable-any-whitespace", DECODING, False,
             "No whitespace between the tokens of guided JSON.", "bool", convert=values.boolean),
    Argument("guided-decoding-disable-additional-properties", DECODING, False,
             "JSON schemas' objects take only the properties they list.", "bool",
             convert=values.boolean),
    Argument("structured-outputs-config", DECODING, {},
             "vLLM's newer form of the four --guided-decoding-* settings, as JSON: "
             '{"backend": "guidance", "disable_any_whitespace": true}; it wins where both '
             "are given. enable_in_reasoning: true constrains the reasoning too.", "json",
             convert=values.json_settings(
                 {
                     "backend": values.one_of(*_STRUCTURED_OUTPUT_BACKENDS),
                     "disable_fallback": values.boolean,
                     "disable_any_whitespace": values.boolean,
                     "disable_additional_properties": values.boolean,
                     "enable_in_reasoning": values.boolean,
                 },
                 unsupported=("reasoning_parser", "reasoning_parser_plugin"),
             )),
    vllm_only("enable-reasoning", DECODING, None,
          "Deprecated in vLLM (--reasoning-parser alone enables reasoning).", "bool"),
    Argument("reasoning-parser", DECODING, "",
             "Split a chat answer's <think>...</think> part into the message's `reasoning` "
             "field (engine/reasoning_parsers.py lists the parsers).", convert=values.string,
             choices=("", *REASONING_PARSERS), vllm_choices=VLLM_OTHER_REASONING_PARSERS,
             choice_noun="reasoning parser"),
    Argument("reasoning-config", VLLM, {},
             "The markers of a thought, for requests' thinking_token_budget, as JSON: "
             '{"reasoning_start_str": "<think>", "reasoning_end_str": "Time is up.</think>"}: '
             "once a thought's tokens reach the budget, the end string is forced. Without "
             "them, the reasoning parser's markers (--reasoning-parser, or this JSON's "
             "reasoning_parser key); a thought also ends at the parser's own end marker.",
             "json", convert=values.json_settings({
                 "reasoning_parser": values.one_of(*REASONING_PARSERS),
                 "reasoning_start_str": values.string,
                 "reasoning_end_str": values.string,
             })),
    *PARALLEL_ARGUMENTS,  # config/parallel_arguments.py
    # --- CacheConfig -----------------------------------------------------------------------
    # The CPU's decodes weigh a key block's slots of one component as one row, and read a
    # kv head's block as one run (kernels/decode_in_pool.py): 128 slots, vLLM-CPU's default,
    # are 256-byte rows and 16 KiB runs in bfloat16, which the CPU streams from memory where
    # 32 slots' 4 KiB runs stall on each run's first access (bench/RESULTS.md).
    Argument("block-size", CACHE, PlatformDefault(cpu=128, gpu=16), "Tokens per KV-cache block.",
             convert=values.integer, choices=(1, 8, 16, 32, 64, 128)),
    Argument("gpu-memory-utilization", CACHE, 0.9,
             "Share of device memory (greater than 0, at most 1) this instance may use for "
             "weights, activations and KV cache. On the CPU the KV cache size comes from "
             f"{CPU_KVCACHE_SPACE_ENV} (GiB, default {DEFAULT_CPU_KVCACHE_SPACE_GIB:g}). "
             "--device-memory-utilization is vLLM 0.32's other name for it.",
             convert=values.fraction, aliases=("--device-memory-utilization",)),
    vllm_only("swap-space", CACHE, 4, "CPU swap space per GPU, in GiB."),
    Argument("kv-cache-dtype", CACHE, "auto",
             "Storage type of the KV cache: auto (the model's dtype) or fp8 (= fp8_e4m3; "
             "float8_e4m3fnuz on ROCm's MI300) and fp8_e5m2, one byte an element, so twice the "
             "blocks of a 16-bit cache fit in the same memory. An fp8 cache is scaled per "
             "layer by the checkpoint's k_scale/v_scale when it has them, else by 1.0 "
             "(or see --calculate-kv-scales).",
             convert=values.string, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
             vllm_choices=("fp8_inc",), choice_noun="KV-cache dtype"),
    Argument("kv-cache-memory-bytes", CACHE, None,
             "Size of the KV cache in bytes (4G, 512M, 1.5g, ...): on a GPU instead of what "
             "--gpu-memory-utilization leaves, on the CPU instead of VLLM_CPU_KVCACHE_SPACE's "
             "4 GiB default (the variable, when set, still wins, as in vLLM 0.32). Default: "
             "from those.", convert=values.byte_count),
    Argument("num-gpu-blocks-override", CACHE, None,
             "Use this many KV-cache blocks instead of the number that fits in memory (for tests).",
             convert=values.integer_at_least(1)),
    Argument("enable-prefix-caching", CACHE, True,
             "Reuse the KV cache of shared prompt prefixes.", "bool", convert=values.boolean),
    Argument("prefix-caching-hash-algo", CACHE, "sha256",
             "How prefix-cache blocks are keyed: sha256 (pickled, collision resistant), "
             "sha256_cbor (canonical CBOR, the same keys from any language), xxhash and "
             "xxhash_cbor (faster, not collision resistant; need the xxhash package), "
             "builtin (Python's hash) and sha256_cbor_64bit (earlier vLLM's).",
             convert=values.string, choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor",
                                             "builtin", "sha256_cbor_64bit")),
    vllm_only("cpu-offload-gb", CACHE, 0, "GiB of weights per GPU kept in CPU memory."),
    Argument("calculate-kv-scales", CACHE, False,
             "With an fp8 --kv-cache-dtype: compute each layer's scales from the keys and "
             "values of the first step that writes them (max |key| / 200, max |value| / 100, "
             "as vLLM), instead of taking the checkpoint's (else 1.0).", "bool",
             convert=values.boolean),
    vllm_only("kv-sharing-fast-prefill", CACHE, False, "Fast prefill for KV-sharing models.", "bool"),
    vllm_only("mamba-cache-dtype", CACHE, "auto", "dtype of the Mamba state cache.", choices=("auto", "float32")),
    vllm_only("mamba-ssm-cache-dtype", CACHE, "auto", "dtype of the Mamba SSM state.",
          choices=("auto", "float32")),
    # --- MultiModalConfig ------------------------------------------------------------------
    Argument("limit-mm-per-prompt", MULTIMODAL, {},
             "Most items of each modality a prompt may carry, e.g. {\"image\": 2} (999 for a "
             "modality not named).", "json", convert=multimodal.mm_limits),
    vllm_only("media-io-kwargs", MULTIMODAL, {}, "Options for loading media, per modality.", "json"),
    vllm_only("mm-processor-kwargs", MULTIMODAL, None, "Overrides for the HF multimodal processor.", "json"),
    vllm_only("mm-processor-cache-gb", MULTIMODAL, 4, "Size of the multimodal processor cache, in GiB."),
    vllm_only("disable-mm-preprocessor-cache", MULTIMODAL, False,
          "Do not cache processed multimodal inputs.", "bool"),
    vllm_only("mm-cache-preprocessor", MULTIMODAL, False, "Cache processed multimodal inputs.", "flag"),
    vllm_only("mm-encoder-tp-mode", MULTIMODAL, "weights",
          "With tensor parallelism, shard the vision encoder's weights or its batch.",
          choices=("weights", "data")),
    vllm_only("interleave-mm-strings", MULTIMODAL, False, "Allow interleaved text and media.", "bool"),
    vllm_only("skip-mm-profiling", MULTIMODAL, False, "Skip multimodal memory profiling.", "bool"),
    # --- LoRAConfig ------------------------------------------------------------------------
    Argument("enable-lora", LORA, False,
             "Serve LoRA adapters (PEFT folders): each is a model name of its own, given with "
             "--lora-modules or loaded at run time (/v1/load_lora_adapter, with "
             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). On a GPU decode steps then run without "
             "CUDA/HIP graphs.", "bool", convert=values.boolean),
    vllm_only("enable-lora-bias", LORA, False, "Support bias terms in LoRA adapters.", "bool"),
    Argument("max-loras", LORA, 1, "Most distinct LoRA adapters in one batch.",
             convert=values.integer_at_least(1)),
    Argument("max-lora-rank", LORA, 16, "Largest LoRA rank an adapter may have.",
             convert=values.integer, choices=(1, 8, 16, 32, 64, 128, 256, 320, 512)),
    vllm_only("lora-extra-vocab-size", LORA, 256, "Most extra vocabulary tokens a LoRA may add."),
    Argument("lora-dtype", LORA, "auto",
             "dtype of the LoRA weights; auto: the model's.",
             convert=values.string, choices=("auto", "float16", "bfloat16")),
    vllm_only("long-lora-scaling-factors", LORA, None, "Extra RoPE scaling factors for Long-LoRA.", "list"),
    Argument("max-cpu-loras", LORA, None,
             "LoRA adapters kept loaded in host memory, the least recently used dropped "
             "first (at least --max-loras; default: --max-loras).",
             convert=values.integer_at_least(1)),
    vllm_only("fully-sharded-loras", LORA, False, "Shard all of the LoRA computation.", "bool"),
    vllm_only("default-mm-loras", LORA, None, "LoRA applied when a given modality is present.", "json"),
    # --- PromptAdapterConfig ---------------------------------------------------------------
    vllm_only("enable-prompt-adapter", PROMPT_ADAPTER, None, "Serve prompt adapters.", "bool"),
    vllm_only("max-prompt-adapters", PROMPT_ADAPTER, 1, "Most prompt adapters in a batch."),
    vllm_only("max-prompt-adapter-token", PROMPT_ADAPTER, 0, "Most virtual tokens in a prompt adapter."),
    # --- SpeculativeConfig -----------------------------------------------------------------
    Argument("speculative-config", SPECULATIVE, None,
             "Speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": "
             "4, \"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2} drafts tokens by finding "
             "the output's last n-gram earlier in the sequence; a step checks them all at once "
             "(engine/speculation.py). Without --async-scheduling.", "json",
             convert=speculative_settings, aliases=("-sc",)),
    Argument("spec-method", VLLM, None,
             "vLLM 0.32's shorthand for --speculative-config's method: ngram.",
             convert=values.string, choices=("ngram",), vllm_choices=_VLLM_SPEC_METHODS,
             choice_noun="speculative method"),
    Argument("spec-model", VLLM, None,
             "vLLM 0.32's shorthand for --speculative-config's model (the draft model; "
             "n-gram lookup has none, so only ngram).", convert=spec_model),
    Argument("spec-tokens", VLLM, None,
             "vLLM 0.32's shorthand for --speculative-config's num_speculative_tokens.",
             convert=values.integer_at_least(1)),
    vllm_only("speculative-model", SPECULATIVE, None, "Draft model."),
    vllm_only("speculative-model-quantization", SPECULATIVE, None, "Quantization of the draft model."),
    vllm_only("num-speculative-tokens", SPECULATIVE, None, "Tokens the draft proposes per step."),
    vllm_only("speculative-disable-mqa-scorer", SPECULATIVE, False,
          "Score drafts by batch expansion instead of MQA.", "flag"),
    vllm_only("speculative-draft-tensor-parallel-size", SPECULATIVE, None,
          "Tensor-parallel size of the draft model.", aliases=("-spec-draft-tp",)),
    vllm_only("speculative-max-model-len", SPECULATIVE, None, "Longest sequence the draft handles."),
    vllm_only("speculative-disable-by-batch-size", SPECULATIVE, None,
          "Stop speculating when more requests than this are queued."),
    vllm_only("ngram-prompt-lookup-max", SPECULATIVE, None, "Largest n-gram for prompt lookup."),
    vllm_only("ngram-prompt-lookup-min", SPECULATIVE, None, "Smallest n-gram for prompt lookup."),
    vllm_only("spec-decoding-acceptance-method", SPECULATIVE, "rejection_sampler",
          "How draft tokens are accepted.", choices=("rejection_sampler", "typical_acceptance_sampler")),
    vllm_only("typical-acceptance-sampler-posterior-threshold", SPECULATIVE, 0.09,
          "Lowest posterior probability typical acceptance accepts."),
    vllm_only("typical-acceptance-sampler-posterior-alpha", SPECULATIVE, 0.3,
          "Entropy scaling of typical acceptance."),
    vllm_only("disable-logprobs-during-spec-decoding", SPECULATIVE, True,
          "Skip logprobs while speculating.", "optional"),
    *OBSERVABILITY_ARGUMENTS,
    # --- SchedulerConfig -------------------------------------------------------------------
    # vLLM-CPU's defaults by usage context: 2048 tokens and 128 sequences for its server,
    # 4096 and 256 for its LLM class (the offline benchmarks).
    Argument("max-num-batched-tokens", SCHEDULER,
             PlatformDefault(cpu=4096, gpu=8192, cpu_server=2048),
             "Token budget of one scheduler step; without chunked prefill at least "
             "--max-model-len.",
             convert=values.integer_at_least(1)),
    Argument("max-num-seqs", SCHEDULER, PlatformDefault(cpu=256, gpu=256, cpu_server=128),
             "Most sequences in one step.", convert=values.integer_at_least(1)),
    Argument("max-num-queued-reqs", SCHEDULER, None,
             "Most requests in flight, waiting or running (one with n > 1 counts n times); "
             "beyond it a new request is answered 503 with Retry-After at once. Default: no "
             "limit.", convert=values.integer_at_least(1)),
    Argument("max-num-queued-tokens", SCHEDULER, None,
             "Prompt tokens of the requests still in prefill (whole prompts) at which new "
             "requests are answered 503 with Retry-After at once; k/m/g and K/M/G suffixes "
             "as for --max-model-len. Default: no limit.", convert=values.token_count),
    Argument("max-num-partial-prefills", SCHEDULER, 1,
             "With chunked prefill, most prompts left partly prefilled at once; each prefill "
             "chunk of a step takes at most --max-num-batched-tokens divided by the step's "
             "prefills, so that several prompts progress side by side.",
             convert=values.integer),
    Argument("max-long-partial-prefills", SCHEDULER, 1,
             "Of those, most prompts longer than --long-prefill-token-threshold (with 0: 4% of "
             "--max-model-len); a long prompt beyond it waits a step while shorter ones behind "
             "it start. At most --max-num-partial-prefills.",
             convert=values.integer),
    Argument("long-prefill-token-threshold", SCHEDULER, 0,
             "Most tokens one sequence computes in a step while others run or wait, so that "
             "a long prompt does not take the whole step; at most --max-model-len. 0: no "
             "cap.", convert=values.integer_at_least(0)),
    *SCHEDULER_032_ARGUMENTS,
    Argument("stream-interval", SCHEDULER, 1,
             "Tokens a streamed answer gathers before it sends a chunk (the first token and "
             "the end are sent at once); a request's stream_interval may raise it, not lower "
             "it. 1 sends every step's tokens.", convert=values.integer_at_least(1)),
    Argument("cuda-graph-sizes", SCHEDULER, [],
             "Decode batch sizes captured as CUDA/HIP graphs; a decode step is padded to the "
             "smallest that holds it. One value N: 1, 2, 4 and the multiples of 8 up to N; "
             "several: those. Default: N = min(2 * --max-num-seqs, 512) on a GPU; on the "
             "CPU none (given, the CPU pads to them from static buffers, without graphs).",
             "list", convert=values.positive_integers),
    vllm_only("num-lookahead-slots", SCHEDULER, 0, "Extra KV slots per sequence for speculation."),
    Argument("scheduler-delay-factor", SCHEDULER, 0.0,
             "While requests run, hold waiting prompts back until the oldest of them has "
             "waited longer than this factor times the latency of the last step that "
             "admitted prompts (from its scheduling to the next one after its result), so "
             "that prompts start in batches (vLLM V0's rule); with nothing running a prompt "
             "starts at once. 0: no delay.", convert=values.non_negative_number),
    Argument("preemption-mode", SCHEDULER, None,
             "How preempted sequences are evicted. aioserve always recomputes them (frees "
             "their blocks and prefills them again, as vLLM V1 does): recompute is accepted, "
             "swap (V0's copy to host memory) refused. Default: recompute.",
             convert=values.string, choices=("recompute",), vllm_choices=("swap",),
             choice_noun="preemption mode"),
    vllm_only("num-scheduler-steps", SCHEDULER, 1, "Forward steps per scheduler call."),
    vllm_only("multi-step-stream-outputs", SCHEDULER, True, "With multi-step, stream after every step.", "bool"),
    Argument("scheduling-policy", SCHEDULER, "fcfs",
             "fcfs serves requests in arrival order; priority serves lower priority values "
             "first, ties in arrival order.", convert=values.string, choices=("fcfs", "priority")),
    Argument("enable-chunked-prefill", SCHEDULER, True,
             "Split long prompts into chunks batched with decodes.", "bool",
             convert=values.boolean),
    vllm_only("disable-chunked-mm-input", SCHEDULER, False, "Never split one multimodal item.", "bool"),
    vllm_only("scheduler-cls", SCHEDULER, "vllm.core.scheduler.Scheduler", "Scheduler class."),
    vllm_only("disable-hybrid-kv-cache-manager", SCHEDULER, False,
          "Same KV allocation for every layer type.", "bool"),
    Argument("async-scheduling", SCHEDULER, PlatformDefault(cpu=False, gpu=True),
             "Schedule and prepare step N+1 while step N runs, so that the device never waits "
             "for the host; outputs reach the host one step later. Off on the CPU, where host "
             "and model share the cores.", "bool",
             convert=values.boolean),
    # --- VllmConfig ------------------------------------------------------------------------
    Argument("compilation-config", VLLM, CompilationSettings(),
             "torch.compile and CUDA-graph settings: a level 0-3 or JSON (also -O with JSON, "
             "-O.level=0). Level 0 runs the CPU's model step eagerly (CUDA/HIP graphs kept); "
             "1-3 compile it; not given, --optimization-level decides. JSON keys: level (or "
             "mode), cudagraph_mode (FULL_DECODE_ONLY, or NONE: no graphs and no padded "
             "decodes), use_cudagraph, cudagraph_capture_sizes (exactly these sizes), "
             "max_capture_size (or max_cudagraph_capture_size: the largest of the default "
             "sizes); -cc.level=0 sets one key. Other keys are refused by name.",
             "json", convert=compilation_config, aliases=("-cc",)),
    Argument("cudagraph-capture-sizes", VLLM, None,
             "vLLM 0.32's shorthand for --compilation-config's cudagraph_capture_sizes: the "
             "decode batch sizes captured (padded to on the CPU), exactly these.",
             "list", convert=values.positive_integers),
    Argument("max-cudagraph-capture-size", VLLM, None,
             "vLLM 0.32's shorthand for --compilation-config's max_cudagraph_capture_size: "
             "the largest of the default decode graph sizes.",
             convert=values.integer_at_least(1)),
    *OPTIMIZATION_ARGUMENTS,
    vllm_only("kv-transfer-config", VLLM, None, "KV-cache transfer between instances.", "json"),
    Argument("kv-events-config", VLLM, None,
             "KV-cache events for KV-aware routers, as JSON (vLLM's KVEventsConfig): "
             '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"} publishes the '
             "prefix-cache blocks stored, evicted and cleared, once a step, over ZMQ in "
             "vLLM's format (needs prefix caching and pip install pyzmq msgspec). Keys: "
             "enable_kv_cache_events, publisher (null, zmq), endpoint, replay_endpoint, "
             "buffer_steps, hwm, max_queue_size, topic.", "json", convert=kv_events_settings),
    vllm_only("additional-config", VLLM, {}, "Settings for a platform plugin.", "json"),
    # --- TokenizerPoolConfig ---------------------------------------------------------------
    vllm_only("tokenizer-pool-size", TOKENIZER_POOL, 0, "Deprecated in vLLM: size of the tokenizer pool."),
    vllm_only("tokenizer-pool-type", TOKENIZER_POOL, "ray", "Deprecated in vLLM: type of the tokenizer pool."),
    vllm_only("tokenizer-pool-extra-config", TOKENIZER_POOL, {},
          "Deprecated in vLLM: tokenizer-pool settings.", "json"),
    # --- DeviceConfig ----------------------------------------------------------------------
    Argument("device", DEVICE, "auto",
             "Deprecated in vLLM, which finds the device itself, as aioserve does: auto, or "
             "the device this machine computes on, checked at start (cpu; cuda for an NVIDIA "
             "or AMD GPU, as torch names both).", convert=values.string,
             choices=("auto", "cuda", "cpu"),
             vllm_choices=("neuron", "openvino", "tpu", "xpu", "hpu"), choice_noun="device"),
    *RECENT_ARGUMENTS,
)
# fmt: on

_BY_DEST: dict[str, Argument] = {argument.dest: argument for argument in ARGUMENTS}


def argument(dest: str) -> Argument | None:
    """The declaration whose snake_case name is `dest`, if any."""
    return _BY_DEST.get(dest)
