"""The images of a chat request: its `image_url` content parts read into PIL images, as
vLLM's MediaConnector reads them.

A URL is a base64 `data:` URL, an `http(s)://` URL fetched within VLLM_IMAGE_FETCH_TIMEOUT
seconds (5, vLLM's), or a `file://` URL inside --allowed-local-media-path (none without
it). Each image is made RGB, a transparent one over white, as vLLM's default image mode.
vLLM's messages and statuses: 400 for a malformed URL or an unreadable image, 422 for a
fetch the server answered with a client error (4xx but 408/429), 500 for a fetch that
failed otherwise (a timeout, a refused connection: worth a retry).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

import aiohttp

from aioserve.config.multimodal import DEFAULT_MM_LIMIT
from aioserve.engine.admission import InvalidRequest
from aioserve.engine.async_engine import AsyncEngine
from aioserve.engine.multimodal import widened_prompt
from aioserve.server.errors import APIError
from aioserve.server.protocol import ChatRequest

IMAGE_FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"
_DEFAULT_FETCH_TIMEOUT_S = 5


def image_placeholder(engine: AsyncEngine) -> str | None:
    """The text standing for an image in a prompt (the image token's, LLaVA's "<image>");
    None for a model that takes no images."""
    processor = engine.image_processor
    if processor is None or engine.tokenizer is None:
        return None
    return engine.tokenizer.convert_ids_to_tokens(processor.image_token_id)


async def read_request_images(engine: AsyncEngine, parsed: ChatRequest) -> str | None:
    """Read the images of a chat request's messages into `parsed.images`, where the model
    takes images; returns the placeholder its template gets for each (None: the model
    takes none, and image parts are refused as it renders)."""
    placeholder = image_placeholder(engine)
    if placeholder is not None:
        urls = image_urls(parsed.messages)
        check_image_count(engine, len(urls))
        parsed.images = await load_images(urls, engine.settings.allowed_local_media_path)
    return placeholder


def check_image_count(engine: AsyncEngine, num_images: int) -> None:
    """400 for more images than --limit-mm-per-prompt lets a prompt carry (before any is
    read)."""
    limit = engine.settings.limit_mm_per_prompt.get("image", DEFAULT_MM_LIMIT)
    if num_images > limit:
        raise APIError(f"At most {limit} image(s) may be provided in one prompt.")


def widened_prompt_ids(engine: AsyncEngine, token_ids: list[int], num_images: int) -> list[int]:
    """The rendered prompt's token ids with each image's placeholder widened to its rows
    (so that its length is checked as the engine will count it); 400 when the prompt's
    placeholders and images differ in number."""
    try:
        return widened_prompt(engine.image_processor, token_ids, num_images)[0]
    except InvalidRequest as error:
        raise APIError(str(error), param="messages") from None


def image_urls(messages: list) -> list[str]:
    """The URL of each `image_url` part of the (checked) messages, in order."""
    urls = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                urls.append(_part_url(f"messages[{index}].content[{j}]", part))
    return urls


def _part_url(where: str, part: dict[str, Any]) -> str:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise APIError(
            f"{where}: an image_url part needs image_url.url (a string)", param="messages"
        )
    return url


async def load_images(urls: list[str], allowed_folder: str) -> list[Any]:
    """The images at `urls`, read concurrently; APIError for one that cannot be read."""
    return list(await asyncio.gather(*(load_image(url, allowed_folder) for url in urls)))


async def load_image(url: str, allowed_folder: str) -> Any:
    if url[:5].lower() == "data:":
        data = _data_url_bytes(url)
    else:
        parts = urlsplit(url)
        if parts.scheme in ("http", "https"):
            data = await _fetch(url)
        elif parts.scheme == "file":
            data = await asyncio.to_thread(_read_file, parts, allowed_folder)
        else:
            raise APIError("The URL must be either a HTTP, data or file URL.")
    return await asyncio.to_thread(_decoded_rgb, data)


def _data_url_bytes(url: str) -> bytes:
    spec, comma, data = url[5:].partition(",")
    if not comma:
        raise APIError(f"Invalid data URL {url[:32]!r}: missing ',' separator.")
    _media_type, semicolon, encoding = spec.rpartition(";")
    if not semicolon or encoding != "base64":
        raise APIError("Only base64 data URLs are supported for now.", HTTPStatus.NOT_IMPLEMENTED)
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as error:
        raise APIError(f"Invalid base64 data in the image's data URL: {error}") from None


async def _fetch(url: str) -> bytes:
    timeout = aiohttp.ClientTimeout(total=_fetch_timeout_s())
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(url) as response:
                if 400 <= response.status < 500 and response.status not in (408, 429):
                    raise APIError(
                        f"Failed to fetch media from {url}: HTTP {response.status}",
                        HTTPStatus.UNPROCESSABLE_ENTITY,
                    )
                response.raise_for_status()
                return await response.read()
    except APIError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        reason = str(error) or type(error).__name__
        raise APIError(
            f"Failed to fetch media from {url}: {reason}", HTTPStatus.INTERNAL_SERVER_ERROR
        ) from None


def _fetch_timeout_s() -> int:
    raw = os.environ.get(IMAGE_FETCH_TIMEOUT_ENV)
    return _DEFAULT_FETCH_TIMEOUT_S if raw is None else int(raw)


def _read_file(parts: Any, allowed_folder: str) -> bytes:
    if not allowed_folder:
        raise APIError(
            "Cannot load local files without `--allowed-local-media-path`.",
            HTTPStatus.INTERNAL_SERVER_ERROR,
        )
    path = Path(url2pathname(parts.netloc + parts.path))
    if Path(allowed_folder) not in path.resolve().parents:
        raise APIError(
            f"The file path {path} must be a subpath of `--allowed-local-media-path "
            f"{allowed_folder}`."
        )
    try:
        return path.read_bytes()
    except OSError as error:
        raise APIError(f"Cannot read {path}: {error.strerror}") from None


def _decoded_rgb(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as error:
        raise APIError(str(error)) from None
    if image.mode == "RGB":
        return image
    transparent = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    if not transparent:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    rgb = Image.new("RGB", rgba.size, (255, 255, 255))
    rgb.paste(rgba, mask=rgba.split()[3])
    return rgb
