"""vLLM 0.32's scale-out routes (server/scale_out.py): off by default (vLLM's 403), and the
render routes with --enable-scale-out, on the shared in-process engine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.server.conftest import serve_built
from tests.server.openai_helpers import post

SCALE_OUT_PATHS = [
    "/v1/chat/completions/render",
    "/v1/messages/render",
    "/v1/completions/render",
    "/v1/responses/render",
    "/v1/chat/completions/derender",
    "/v1/completions/derender",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
]

# vLLM 0.32's body, from register_scale_out_api_routers' disabled_scale_out.
DISABLED = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with "
        "--enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}


@pytest.fixture(scope="module")
def default_url(server_loop, engine) -> Iterator[str]:
    with serve_built(server_loop, engine) as url:
        yield url


@pytest.mark.parametrize("path", SCALE_OUT_PATHS)
def test_without_the_flag_each_path_answers_vllms_403(default_url, path):
    reply = post(default_url, path, {"model": "x", "prompt": "hi"})
    assert reply.status == 403
    assert reply.json() == DISABLED
