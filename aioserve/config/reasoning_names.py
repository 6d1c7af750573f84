"""The names --reasoning-parser takes: those aioserve implements (engine/reasoning_parsers.py
holds their markers; a test checks the two lists agree) and vLLM 0.32's others, refused by
name (vllm/reasoning/__init__.py)."""

from __future__ import annotations

REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "ernie45", "glm45", "glm47", "granite", "holo2",
    "hunyuan_a13b", "kimi_k2", "ling3", "mimo", "minimax_m2", "minimax_m2_append_think",
    "mistral", "nemotron_v3", "olmo3", "qwen3", "seed_oss", "step3", "step3p5",
)  # fmt: skip
VLLM_OTHER_REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_v4", "deepseek_v41", "gemma4",
    "granite_thinking_parser", "hf", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k3",
    "minicpmv", "minimax_m3", "muse_glimmer", "openai_gptoss", "plamo3", "poolside_v1",
)  # fmt: skip
