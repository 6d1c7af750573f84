"""Record vLLM 0.32's answers on the scale-out render and derender routes, for
tests/server/test_scale_out_family.py to hold aioserve's to.

Run it with the Python of a vLLM 0.32 install, against vLLM's own GPU-less render server
(`vllm launch render`, which serves every render and derender route) on SmolLM2-135M-Instruct
(a folder with its config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja), context 2,048, started once without parsers
and once with the parsers the parsed cases need (qwen3's reasoning parser and hermes tool
calls, both of which vLLM builds on SmolLM2's tokenizer):

    vllm launch render --model SMOLLM2_DIR --served-model-name SmolLM2-135M-Instruct \
        --max-model-len 2048 --port 8711
    vllm launch render ... --port 8713 --reasoning-parser qwen3 \
        --enable-auto-tool-choice --tool-call-parser hermes
    python tools/record_scale_out_vllm.py SMOLLM2_DIR http://localhost:8711 \
        http://localhost:8713 > tests/server/scale_out_family_vllm.json

(On a CPU-only machine with vLLM's wheel unpacked rather than installed,
`VLLM_TARGET_DEVICE=cpu python -m vllm.entrypoints.launchers.render.entry --model ...`
starts the same server.) Each case is a route, a body (and headers), vLLM's status and its
answer; the parsed ones are marked `parsers`. A streamed derender is recorded step by step:
each step's body carries the `stream_state` vLLM answered the step before.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from transformers import AutoTokenizer

MODEL = "SmolLM2-135M-Instruct"


def post(url: str, path: str, body: Any, headers: dict[str, str]) -> tuple[int, Any]:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


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


def main() -> None:
    model_dir, url = sys.argv[1], sys.argv[2]
    tools_url = sys.argv[3] if len(sys.argv) > 3 else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cases = []
    for name, path, body, headers in render_cases():
        status, answer = post(url, path, body, headers)
        cases.append(
            dict(name=name, path=path, headers=headers, body=body, status=status, answer=answer)
        )
    for name, path, body in derender_cases(tokenizer):
        status, answer = post(url, path, body, {})
        cases.append(
            dict(name=name, path=path, headers={}, body=body, status=status, answer=answer)
        )
    for name, path, fixed, chunks in stream_sequences(tokenizer):
        state = None
        for step, generate_chunk in enumerate(chunks):
            body = {"stream": True, **fixed, "generate_chunk": generate_chunk}
            if state is not None:
                body["stream_state"] = state
            status, answer = post(url, path, body, {})
            cases.append(
                dict(
                    name=f"{name}_{step}",
                    path=path,
                    headers={},
                    body=body,
                    status=status,
                    answer=answer,
                )
            )
            state = answer.get("stream_state") if status == 200 else None
    if tools_url is not None:
        for name, path, body, chunks in parser_cases(tokenizer):
            if chunks is None:
                status, answer = post(tools_url, path, body, {})
                cases.append(
                    dict(
                        name=name,
                        path=path,
                        headers={},
                        body=body,
                        status=status,
                        answer=answer,
                        parsers=True,
                    )
                )
                continue
            state = None
            for step, generate_chunk in enumerate(chunks):
                step_body = {"stream": True, **body, "generate_chunk": generate_chunk}
                if state is not None:
                    step_body["stream_state"] = state
                status, answer = post(tools_url, path, step_body, {})
                cases.append(
                    dict(
                        name=f"{name}_{step}",
                        path=path,
                        headers={},
                        body=step_body,
                        status=status,
                        answer=answer,
                        parsers=True,
                    )
                )
                state = answer.get("stream_state") if status == 200 else None
    json.dump({"cases": cases}, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
