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

from scale_out_vllm_cases import derender_cases, parser_cases, render_cases, stream_sequences
from transformers import AutoTokenizer


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
