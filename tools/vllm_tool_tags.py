"""Prints the structured output vLLM's own parser sets on chat requests with tools, for
tests/server/vllm_tool_tags.json (tests/server/test_tool_forced_tags.py holds aioserve's
tags to it).

Run with an installed vLLM (or its wheel unpacked on PYTHONPATH):

    python tools/vllm_tool_tags.py > tests/server/vllm_tool_tags.json

Each case runs a ChatCompletionRequest through the request adjustment of the parser that
`--enable-auto-tool-choice --tool-call-parser NAME --tool-strict-level LEVEL` gives
(vllm/parser/abstract_parser.py adjust_request: _apply_structural_tag, then the tool
parser's JSON forcing), once with VLLM_ENFORCE_STRICT_TOOL_CALLING unset and once with it
"0", each in a process of its own (vLLM reads it when a parser class is defined).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": CITY,
        "strict": True,
    },
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters, not strict
TOOLS = [WEATHER, TIME, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_time"}}
NAMED_STRICT = {"type": "function", "function": {"name": "get_weather"}}

PARSERS = ("hermes", "llama3_json", "qwen3_coder", "deepseek_v3")


def cases() -> dict[str, dict]:
    """Name → {parser, level, body}."""
    out = {}
    for parser in PARSERS:
        for choice_name, choice in (
            ("required", "required"),
            ("named", NAMED),
            ("named_strict", NAMED_STRICT),
        ):
            for parallel in (None, True, False):
                body = {"tools": TOOLS, "tool_choice": choice}
                if parallel is not None:
                    body["parallel_tool_calls"] = parallel
                name = f"{parser}-{choice_name}-parallel_{str(parallel).lower()}"
                out[name] = {"parser": parser, "level": "auto", "body": body}
        out[f"{parser}-required-level_parameter"] = {
            "parser": parser,
            "level": "parameter",
            "body": {"tools": TOOLS, "tool_choice": "required"},
        }
        out[f"{parser}-named-level_parameter"] = {
            "parser": parser,
            "level": "parameter",
            "body": {"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False},
        }
        for level in ("auto", "function"):
            for parallel in (None, False):
                body = {"tools": TOOLS, "tool_choice": "auto"}
                if parallel is not None:
                    body["parallel_tool_calls"] = parallel
                name = f"{parser}-auto-level_{level}-parallel_{str(parallel).lower()}"
                out[name] = {"parser": parser, "level": level, "body": body}
        out[f"{parser}-auto-not_strict"] = {
            "parser": parser,
            "level": "auto",
            "body": {"tools": [TIME, CLOCK], "tool_choice": "auto"},
        }
    return out


def vllm_output(parser_name: str, level: str, body: dict) -> dict | None:
    """The request's structured output once vLLM's parser has adjusted it:
    {"structural_tag": the tag's JSON} or {"json": the schema}, None when unconstrained."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    class AnyVocab(dict):  # the tool parsers' constructors look their markers up
        def __contains__(self, key):
            return True

        def __missing__(self, key):
            return 1000 + len(key)

        def get(self, key, default=None):
            return self[key]

    class Tokenizer:
        vocab = AnyVocab()

        def get_vocab(self):
            return self.vocab

    parser_cls = ParserManager.get_parser(
        tool_parser_name=parser_name, enable_auto_tools=True, tool_strict_level=level
    )
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body}
    )
    request = parser_cls(Tokenizer(), request.tools).adjust_request(request)
    constraint = request.structured_outputs
    if constraint is None:
        return None
    if constraint.structural_tag is not None:
        return {"structural_tag": json.loads(constraint.structural_tag)}
    return {"json": constraint.json}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        answers = {
            name: vllm_output(case["parser"], case["level"], case["body"])
            for name, case in cases().items()
        }
        json.dump(answers, sys.stdout)
        return
    results = {}
    for enforce in ("1", "0"):
        env = dict(os.environ)
        env.pop("VLLM_ENFORCE_STRICT_TOOL_CALLING", None)
        if enforce == "0":
            env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
        child = subprocess.run(
            [sys.executable, __file__, "--child"], env=env, capture_output=True, check=True
        )
        results[enforce] = json.loads(child.stdout)
    everything = {
        name: {**case, "vllm": results["1"][name], "vllm_not_enforced": results["0"][name]}
        for name, case in cases().items()
    }
    lines = [f"{json.dumps(name)}: {json.dumps(case)}" for name, case in everything.items()]
    sys.stdout.write("{\n" + ",\n".join(lines) + "\n}\n")  # a case a line


if __name__ == "__main__":
    main()
