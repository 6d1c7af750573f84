"""The requests tools/record_scale_out_vllm.py sends to vLLM's render server: the
/v1/messages/render and /v1/responses/render cases, the derenders whole and streamed (a
stream as its chunks, sent in turn with the state each answer gives), and the chat
derenders of a server with parsers. Token ids are SmolLM2's, from the tokenizer given."""

from __future__ import annotations

from typing import Any

MODEL = "SmolLM2-135M-Instruct"


def render_cases() -> list[tuple[str, str, dict[str, Any], dict[str, str]]]:
    """(name, path, body, headers) of the /v1/messages/render and /v1/responses/render cases."""
    hi = [{"role": "user", "content": "What is the capital of France?"}]
    weather = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    rid = {"X-Request-Id": "fixed"}
    messages = [
        ("messages_plain", {"model": MODEL, "max_tokens": 20, "messages": hi}, rid),
        (
            "messages_system_sampling",
            {
                "model": MODEL,
                "max_tokens": 64,
                "system": [{"type": "text", "text": "Be brief."}],
                "messages": hi,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": 20,
                "stop_sequences": ["\n\n"],
            },
            rid,
        ),
        ("messages_stream", {"model": MODEL, "max_tokens": 8, "messages": hi, "stream": True}, rid),
        (
            "messages_turns",
            {
                "model": MODEL,
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Name a colour."},
                ],
            },
            rid,
        ),
        (
            "messages_tools",
            {
                "model": MODEL,
                "max_tokens": 30,
                "messages": hi,
                "tools": [weather],
                "tool_choice": {"type": "any"},
            },
            rid,
        ),
        ("messages_no_model", {"max_tokens": 20, "messages": hi}, rid),
        ("messages_unknown_model", {"model": "nope", "max_tokens": 20, "messages": hi}, rid),
    ]
    responses = [
        (
            "responses_plain",
            {"model": MODEL, "input": "What is 2+2?", "request_id": "resp_fixed"},
            {},
        ),
        (
            "responses_instructions",
            {
                "model": MODEL,
                "input": [{"role": "user", "content": "Hi"}],
                "instructions": "Be brief.",
                "max_output_tokens": 30,
                "temperature": 0.7,
                "top_p": 0.8,
                "request_id": "resp_fixed",
            },
            {},
        ),
        (
            "responses_stream_seed",
            {
                "model": MODEL,
                "input": "Hi",
                "stream": True,
                "seed": 3,
                "max_output_tokens": 5,
                "request_id": "resp_fixed",
            },
            {},
        ),
        (
            "responses_json_schema",
            {
                "model": MODEL,
                "input": "A city as JSON",
                "request_id": "resp_fixed",
                "max_output_tokens": 40,
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "city",
                        "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
                    }
                },
            },
            {},
        ),
        (
            "responses_previous_id",
            {"model": MODEL, "input": "Hi", "previous_response_id": "resp_1"},
            {},
        ),
        ("responses_unknown_model", {"model": "nope", "input": "Hi"}, {}),
    ]
    return [(n, "/v1/messages/render", b, h) for n, b, h in messages] + [
        (n, "/v1/responses/render", b, h) for n, b, h in responses
    ]


def derender_cases(tokenizer) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of the non-streamed derender cases."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    chat_prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    paris = ids("The capital of France is Paris.") + [2]
    emoji = ids(" Héllo 👋 wörld 你好!")
    chat_request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}

    def logprobs(token_ids: list[int], top: int = 2) -> dict[str, Any]:
        return {
            "content": [
                {
                    "token_id": t,
                    "logprob": -0.25 * (i + 1),
                    "rank": 1,
                    "top_logprobs": [
                        {"token_id": t, "logprob": -0.25 * (i + 1), "rank": 1},
                        *(
                            {"token_id": t + k, "logprob": -3.0 - k, "rank": k + 1}
                            for k in range(1, top)
                        ),
                    ],
                }
                for i, t in enumerate(token_ids)
            ]
        }

    def response(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"request_id": "chatcmpl-fixed", "choices": choices, **extra}

    chat = "/v1/chat/completions/derender"
    completion = "/v1/completions/derender"
    return [
        (
            "chat_plain",
            chat,
            {
                "generate_response": response([{"index": 0, "token_ids": paris}]),
                "prompt_tokens": len(chat_prompt),
                "prompt_token_ids": chat_prompt,
            },
        ),
        (
            "chat_two_choices_logprobs",
            chat,
            {
                "model": MODEL,
                "generate_response": response(
                    [
                        {
                            "index": 0,
                            "token_ids": paris[:4],
                            "finish_reason": "length",
                            "logprobs": logprobs(paris[:4]),
                        },
                        {
                            "index": 1,
                            "token_ids": emoji,
                            "finish_reason": "stop",
                            "stop_reason": "!",
                            "logprobs": logprobs(emoji, top=1),
                        },
                    ],
                    kv_transfer_params={"remote_block_ids": [1, 2]},
                ),
                "prompt_tokens": 12,
            },
        ),
        (
            "chat_request_options",
            chat,
            {
                "generate_response": response(
                    [{"index": 0, "token_ids": paris}],
                    prompt_token_ids=chat_prompt,
                ),
                "chat_request": {
                    **chat_request,
                    "skip_special_tokens": False,
                    "return_token_ids": True,
                },
            },
        ),
        (
            "chat_emoji_without_prompt",
            chat,
            {"generate_response": response([{"index": 0, "token_ids": emoji[3:]}])},
        ),
        (
            "chat_empty_token_ids",
            chat,
            {"generate_response": response([{"index": 0, "token_ids": []}])},
        ),
        ("chat_missing_response", chat, {"prompt_tokens": 3}),
        (
            "chat_negative_token",
            chat,
            {"generate_response": response([{"index": 0, "token_ids": [5, -1]}])},
        ),
        (
            "chat_text_mode_refused",
            chat,
            {
                "generate_response": response(
                    [{"index": 0, "token_ids": [5], "text": "x"}], output_mode="text"
                )
            },
        ),
        (
            "chat_unknown_model",
            chat,
            {"model": "nope", "generate_response": response([{"index": 0, "token_ids": [5]}])},
        ),
        (
            "chat_too_long",
            chat,
            {"generate_response": response([{"index": 0, "token_ids": [5] * 2049}])},
        ),
        (
            "chat_prompt_too_long",
            chat,
            {
                "generate_response": response([{"index": 0, "token_ids": [5]}]),
                "prompt_token_ids": [5] * 2049,
            },
        ),
        (
            "completion_two_prompts",
            completion,
            {
                "generate_responses": [
                    {
                        "request_id": "cmpl-fixed-0",
                        "choices": [
                            {"index": 0, "token_ids": paris[:5], "finish_reason": "length"},
                            {"index": 1, "token_ids": emoji[:6], "finish_reason": "length"},
                        ],
                        "kv_transfer_params": {"a": 1},
                    },
                    {
                        "request_id": "cmpl-fixed-1",
                        "choices": [
                            {
                                "index": 0,
                                "token_ids": paris,
                                "logprobs": logprobs(paris),
                            }
                        ],
                        "kv_transfer_params": {"a": 1},
                    },
                ],
                "prompt_tokens": [4, 6],
                "prompt_token_ids": [ids("Hello, world"), None],
            },
        ),
        (
            "completion_request_options",
            completion,
            {
                "model": MODEL,
                "generate_responses": [
                    {
                        "request_id": "cmpl-fixed",
                        "choices": [{"index": 0, "token_ids": paris}],
                        "prompt_token_ids": ids("Hello"),
                        "kv_transfer_params": {"x": 1},
                        "metrics": None,
                    }
                ],
                "completion_request": {
                    "model": MODEL,
                    "prompt": "Hello",
                    "skip_special_tokens": False,
                },
            },
        ),
        ("completion_empty", completion, {"generate_responses": []}),
        (
            "completion_lengths_differ",
            completion,
            {
                "generate_responses": [
                    {"request_id": "c", "choices": [{"index": 0, "token_ids": [5]}]}
                ],
                "prompt_tokens": [1, 2],
            },
        ),
        (
            "completion_empty_token_ids",
            completion,
            {
                "generate_responses": [
                    {"request_id": "c", "choices": [{"index": 0, "token_ids": None}]}
                ]
            },
        ),
        (
            "completion_too_many_top_logprobs",
            completion,
            {
                "generate_responses": [
                    {
                        "request_id": "c",
                        "choices": [{"index": 0, "token_ids": [5], "logprobs": logprobs([5], 21)}],
                    }
                ]
            },
        ),
    ]


def stream_sequences(tokenizer) -> list[tuple[str, str, dict[str, Any], list[dict[str, Any]]]]:
    """(name, path, fixed fields, chunks) of the streamed derenders: each chunk is sent with
    the fixed fields and the state of the step before."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    words = ids(" Héllo 👋 wörld 你好!")
    prompt = ids("Say hello:")

    def chunk(token_ids: list[int] | None, finish: str | None = None, **extra: Any) -> dict:
        choices = []
        if token_ids is not None:
            choice: dict[str, Any] = {"index": 0, "token_ids": token_ids, "finish_reason": finish}
            if extra.pop("logprobs", False):
                choice["logprobs"] = {
                    "content": [
                        {
                            "token_id": t,
                            "logprob": -0.5,
                            "rank": 1,
                            "top_logprobs": [{"token_id": t, "logprob": -0.5, "rank": 1}],
                        }
                        for t in token_ids
                    ]
                }
            choices.append(choice)
        return {"request_id": "stream-fixed", "choices": choices, **extra}

    # The emoji's four bytes come in three tokens: a chunk boundary falls inside it.
    pieces = [words[:3], words[3:5], words[5:9], words[9:]]
    chunks = [chunk(p, logprobs=True) for p in pieces[:-1]]
    chunks.append(chunk(pieces[-1], "stop", logprobs=True))
    chunks.append(
        chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 15, "total_tokens": 18})
    )
    plain_chunks = [chunk(p) for p in pieces[:-1]] + [chunk(pieces[-1] + [2], "stop")]
    # A prompt of more than seven tokens ending in special ones, and an output whose first
    # chunk is only the start of a character: the state shows the prompt's seed.
    long_prompt = ids("Please say hello to everyone here:") + [2, 198, 1]
    split_start = [chunk(words[3:4]), chunk(words[4:6]), chunk(words[6:9], "length")]
    special_kept = {"model": MODEL, "prompt": "x", "skip_special_tokens": False}
    chat = "/v1/chat/completions/derender"
    completion = "/v1/completions/derender"
    return [
        ("chat_stream", chat, {"prompt_token_ids": prompt, "prompt_tokens": 3}, chunks),
        (
            "chat_stream_usage_first",
            chat,
            {
                "chat_request": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "return_token_ids": True,
                }
            },
            [chunk(None, usage={"prompt_tokens": 3, "completion_tokens": 0}), *plain_chunks],
        ),
        (
            "chat_stream_seeded_first",
            chat,
            {"prompt_token_ids": long_prompt},
            [chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 0}), *split_start],
        ),
        (
            "completion_stream_split_start",
            completion,
            {"prompt_token_ids": long_prompt, "completion_request": special_kept},
            split_start,
        ),
        ("completion_stream", completion, {"prompt_token_ids": prompt}, chunks),
        (
            "completion_stream_no_prompt",
            completion,
            {
                "model": MODEL,
                "completion_request": {"model": MODEL, "prompt": "x", "skip_special_tokens": False},
            },
            plain_chunks,
        ),
        (
            "chat_stream_two_choices",
            chat,
            {},
            [
                {
                    "request_id": "s",
                    "choices": [{"index": 0, "token_ids": [5]}, {"index": 1, "token_ids": [6]}],
                }
            ],
        ),
    ]


def parser_cases(tokenizer) -> list[tuple[str, str, dict[str, Any], list[dict[str, Any]] | None]]:
    """(name, path, body or the streamed one's fixed fields, chunks or None) of the chat
    derenders on the server with --reasoning-parser qwen3 and the hermes tool parser."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    chat_request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    tools = {**chat_request, "tools": [weather]}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    thought = "<think>Let me see.</think>Paris."

    def whole(name: str, text: str, request: dict[str, Any] | None, **extra: Any):
        body = {
            "generate_response": {
                "request_id": "chatcmpl-fixed",
                "choices": [{"index": 0, "token_ids": ids(text) + [2]}],
                "prompt_token_ids": prompt,
            },
            "prompt_tokens": len(prompt),
            **extra,
        }
        if request is not None:
            body["chat_request"] = request
        return (name, "/v1/chat/completions/derender", body, None)

    def streamed(name: str, text: str, cuts: list[int], request: dict[str, Any]):
        token_ids = ids(text) + [2]
        bounds = [0, *cuts, len(token_ids)]
        chunks = [
            {
                "request_id": "stream-fixed",
                "choices": [
                    {
                        "index": 0,
                        "token_ids": token_ids[a:b],
                        "finish_reason": "stop" if b == len(token_ids) else None,
                    }
                ],
            }
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        chunks.append(
            {
                "request_id": "stream-fixed",
                "choices": [],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(token_ids)},
            }
        )
        fixed = {"prompt_token_ids": prompt, "chat_request": request}
        return (name, "/v1/chat/completions/derender", fixed, chunks)

    return [
        whole("parsed_reasoning", thought, chat_request),
        whole("parsed_reasoning_opened_by_template", "Let me see.</think>Paris.", chat_request),
        whole(
            "parsed_reasoning_hidden",
            thought,
            {**chat_request, "include_reasoning": False, "return_token_ids": True},
        ),
        whole("parsed_token_ids", thought, {**chat_request, "return_token_ids": True}),
        whole(
            "parsed_not_thinking",
            thought,
            {**chat_request, "chat_template_kwargs": {"enable_thinking": False}},
        ),
        whole("parsed_tool_call", "<think>Hm.</think>\n" + call, tools),
        whole(
            "parsed_tool_call_after_text",
            "Sure." + call,
            {**tools, "chat_template_kwargs": {"enable_thinking": False}},
        ),
        whole("parsed_without_chat_request", thought, None),
        (
            "parsed_stream_without_prompt_ids",
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "chat_request": chat_request,
                "generate_chunk": {"request_id": "s", "choices": [{"index": 0, "token_ids": [5]}]},
            },
            None,
        ),
        streamed("parsed_stream_reasoning", thought, [2, 5, 9, 11], chat_request),
        streamed(
            "parsed_stream_tool_call", "<think>Hm.</think>\n" + call, [3, 8, 14, 20, 27], tools
        ),
    ]
