"""The request fields vLLM 0.32 accepts on each route aioserve serves, for logging the rest.

vLLM's request models (pydantic, extra fields allowed) log the keys of a body that are
neither a field name nor an alias of the route's model ("The following fields were present
in the request but ignored: {...}", at DEBUG). These sets are those names and aliases, so
that aioserve reports the same keys as vLLM does (body_fields.log_ignored_fields). They are
data, copied from vLLM once, because vLLM is not a dependency.

/tokenize takes one of two models (vLLM's TokenizeRequest union): the chat one when the
body has `messages`, the prompt one otherwise.
"""

from __future__ import annotations

# Generated from vLLM 0.32.0 with its own interpreter (~/.cache/aioserve-peers/vllm-venv/
# bin/python): for each request model M (vllm.entrypoints.openai.completion.protocol.
# CompletionRequest, ...chat_completion.protocol.ChatCompletionRequest, and
# vllm.entrypoints.serve.tokenize.protocol's TokenizeCompletionRequest,
# TokenizeChatRequest, DetokenizeRequest)
#     sorted({n for f, info in M.model_fields.items() for n in (f, info.alias) if n})
# which is what OpenAIBaseModel.__log_extra_fields__ compares a body's keys against; and
# REMOVED_GUIDED_FIELDS is vllm.entrypoints.serve.engine.protocol._REMOVED_GUIDED_FIELDS.
# None of these models has an alias in 0.32.0. Regenerate when following a new vLLM.

# POST /v1/completions: CompletionRequest.
COMPLETION_FIELDS: frozenset[str] = frozenset(
    {
        "add_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "cache_salt",
        "ec_transfer_params",
        "echo",
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "kv_transfer_params",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_tokens",
        "min_p",
        "min_tokens",
        "mm_payload",
        "model",
        "n",
        "presence_penalty",
        "priority",
        "prompt",
        "prompt_embeds",
        "prompt_logprobs",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "response_format",
        "return_mm_kwargs",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",
        "suffix",
        "temperature",
        "thinking_token_budget",
        "top_k",
        "top_p",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_beam_search",
        "user",
        "vllm_xargs",
        "watermarking",
    }
)

# POST /v1/chat/completions: ChatCompletionRequest.
CHAT_COMPLETION_FIELDS: frozenset[str] = frozenset(
    {
        "add_generation_prompt",
        "add_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "cache_salt",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "documents",
        "ec_transfer_params",
        "echo",
        "frequency_penalty",
        "ignore_eos",
        "include_reasoning",
        "include_stop_str_in_output",
        "kv_transfer_params",
        "length_penalty",
        "logit_bias",
        "logprob_token_ids",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "media_io_kwargs",
        "messages",
        "min_p",
        "min_tokens",
        "mm_payload",
        "mm_processor_kwargs",
        "model",
        "n",
        "parallel_tool_calls",
        "presence_penalty",
        "priority",
        "prompt_logprobs",
        "reasoning_effort",
        "repetition_detection",
        "repetition_penalty",
        "request_id",
        "response_format",
        "return_mm_kwargs",
        "return_prompt_text",
        "return_token_ids",
        "return_token_offsets",
        "return_tokens_as_token_ids",
        "routed_experts_prompt_start",
        "seed",
        "session_id",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_interval",
        "stream_options",
        "structured_outputs",
        "temperature",
        "thinking_token_budget",
        "tool_choice",
        "tools",
        "top_k",
        "top_logprobs",
        "top_p",
        "truncate_prompt_tokens",
        "truncation_side",
        "use_beam_search",
        "user",
        "vllm_xargs",
        "watermarking",
    }
)

# POST /tokenize with a prompt: TokenizeCompletionRequest.
TOKENIZE_PROMPT_FIELDS: frozenset[str] = frozenset(
    {
        "add_special_tokens",
        "model",
        "prompt",
        "return_token_strs",
    }
)

# POST /tokenize with messages: TokenizeChatRequest.
TOKENIZE_CHAT_FIELDS: frozenset[str] = frozenset(
    {
        "add_generation_prompt",
        "add_special_tokens",
        "chat_template",
        "chat_template_kwargs",
        "continue_final_message",
        "media_io_kwargs",
        "messages",
        "mm_processor_kwargs",
        "model",
        "return_token_strs",
        "tools",
    }
)

# POST /detokenize: DetokenizeRequest.
DETOKENIZE_FIELDS: frozenset[str] = frozenset(
    {
        "model",
        "tokens",
    }
)

# The guided-decoding fields vLLM removed (for structured_outputs): it ignores them with a
# warning; aioserve reads them (structured_output_fields.py).
REMOVED_GUIDED_FIELDS: frozenset[str] = frozenset(
    {
        "guided_choice",
        "guided_decoding_backend",
        "guided_grammar",
        "guided_json",
        "guided_regex",
        "guided_whitespace_pattern",
    }
)
