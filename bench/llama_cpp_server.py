"""llama.cpp's OpenAI server (llama-cpp-python's), accepting the request ids `vllm bench
serve` sends.

llama-cpp-python's server checks each request's `x-request-id` header to be a UUID and
answers 400 to anything else; vLLM's benchmark client names its requests `bench-...`, so
every request it sent was refused. This runs the same server with that check off and
nothing else changed, so that llama.cpp can be driven by the client that drives vLLM and
aioserve (bench/llama_cpp_served.sh). Its arguments are the server's own:

    ~/.cache/aioserve-peers/llama-venv/bin/python bench/llama_cpp_server.py \\
        --model GGUF --n_threads 2 --n_ctx 2048 --model_alias smol --port 8300
"""

from __future__ import annotations

import runpy

from starlette_context import plugins


class _AnyRequestId(plugins.RequestIdPlugin):
    """The server's request-id plugin, which takes any id as it comes."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["validate"] = False
        super().__init__(*args, **kwargs)


# Before the server's app module imports the plugin by name.
plugins.RequestIdPlugin = _AnyRequestId

if __name__ == "__main__":
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
