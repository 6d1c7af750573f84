"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters served from now on, or
no longer (lora_models.py), when VLLM_ALLOW_RUNTIME_LORA_UPDATING allows it, as in vLLM;
otherwise the routes do not exist (404)."""

from __future__ import annotations

from aiohttp import web

from aioserve.server.body_fields import read_json_body
from aioserve.server.errors import APIError
from aioserve.server.lora_models import runtime_updating_allowed
from aioserve.server.state import STATE


def _required_name(body: dict, key: str) -> str:
    value = body.get(key)
    if value is None:
        raise APIError(
            f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.{key}', "
            "'msg': 'Field required'}",
            param=f"body.{key}",
            error_type="Bad Request",
        )
    if not isinstance(value, str):
        raise APIError(
            f"1 validation error:\n  {{'type': 'string_type', 'loc': 'body.{key}', "
            "'msg': 'Input should be a valid string'}",
            param=f"body.{key}",
            error_type="Bad Request",
        )
    return value


async def load_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/load_lora_adapter."""
    loras = request.app[STATE].loras
    body = await read_json_body(request)
    name = _required_name(body, "lora_name")
    path = _required_name(body, "lora_path")
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise APIError("load_inplace must be a boolean", param="load_inplace")
    await loras.load(name, path, inplace=inplace)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """POST /v1/unload_lora_adapter."""
    loras = request.app[STATE].loras
    body = await read_json_body(request)
    name = _required_name(body, "lora_name")
    loras.unload(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    """The runtime load/unload routes, when VLLM_ALLOW_RUNTIME_LORA_UPDATING allows them."""
    if runtime_updating_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
