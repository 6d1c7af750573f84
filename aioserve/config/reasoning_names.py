"""The names --reasoning-parser takes: those aioserve implements (engine/reasoning_parsers.py
holds their markers; a test checks the two lists agree) and vLLM 0.32's others, refused by
name (vllm/reasoning/__init__.py)."""

from __future__ import annotations

REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "glm45", "kimi_k2", "minimax_m2", "minimax_m2_append_think",
    "mistral", "qwen3", "seed_oss", "step3",
)  # fmt: skip
VLLM_OTHER_REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_v4", "deepseek_v41", "ernie45", "gemma4",
    "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3",
    "hy_v4", "inkling", "k2_horizon", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m3",
    "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1",
    "step3p5",
)  # fmt: skip
