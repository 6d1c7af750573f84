"""Images in chat requests over real HTTP with the official client (server/chat_images.py,
chat_messages.py): a tiny LLaVA answers as transformers' LlavaForConditionalGeneration does
on the prompt the server rendered and the image it was sent, whether the image came as a
data URL, a file under --allowed-local-media-path or an http URL; the placeholders land
where vLLM puts them; and every bad image is refused with vLLM's status and message,
leaving the server serving."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from aiohttp import web

from aioserve.config.engine import engine_config_from_kwargs
from aioserve.engine.async_engine import AsyncEngine
from aioserve.server.app import build_app
from aioserve.server.chat_messages import conversation
from aioserve.server.errors import APIError
from aioserve.server.state import ServerState
from tests.models.llava_folders import random_image, write_tiny_llava
from tests.server.conftest import MODEL, serve_app
from tests.server.openai_helpers import client

NEW_TOKENS = 6
QUESTION = "What is in this picture?"


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


@pytest.fixture(scope="module")
def llava(smollm2_gguf, tmp_path_factory) -> tuple[str, int, object]:
    """The tiny LLaVA's folder, its image token, and a folder of images to serve."""
    from aioserve.models.checkpoint import open_checkpoint

    folder = tmp_path_factory.mktemp("llava_http")
    tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
    image_id = write_tiny_llava(folder, tokenizer, "clip")
    media = tmp_path_factory.mktemp("media")
    (media / "cat.png").write_bytes(png_bytes(random_image(7)))
    (media / "notes.txt").write_text("not an image")
    return str(folder), image_id, media


@pytest.fixture(scope="module")
def url(llava, server_loop):
    folder, _, media = llava
    config = engine_config_from_kwargs(
        model=folder,
        dtype="float32",
        seed=0,
        max_model_len=128,
        block_size=8,
        enforce_eager=True,
        allowed_local_media_path=str(media),
        limit_mm_per_prompt={"image": 2},
    )
    engine = AsyncEngine.from_config(config)
    with serve_app(server_loop, build_app(ServerState(engine, [MODEL]))) as base:
        yield base
    server_loop.run(engine.shutdown())


@pytest.fixture(scope="module")
def image_server(server_loop):
    """An http server of one image (and a 404 for anything else)."""

    async def cat(_request: web.Request) -> web.Response:
        return web.Response(body=png_bytes(random_image(7)), content_type="image/png")

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    with serve_app(server_loop, app) as base:
        yield base


def _ask(url: str, *image_urls: str, text: str = QUESTION, **fields):
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return client(url).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "return_prompt_text": True, **fields},
    )


def _hf_greedy(folder: str, prompt_ids: list[int], images: list) -> list[int]:
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    pixels = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    tokens = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, pixel_values=pixels["pixel_values"]).logits[0, -1]
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens


def test_an_image_by_data_url_is_answered_as_transformers_answers(url, llava):
    folder, image_id, _ = llava
    image = random_image(7)
    reply = _ask(url, data_url(image))
    choice = reply.choices[0]
    prompt_ids = reply.prompt_token_ids
    assert prompt_ids.count(image_id) == 16  # one placeholder widened to the image's rows
    # vLLM's "string" content format: the image's placeholder first, on its own line.
    assert f"<image>\n{QUESTION}" in reply.prompt_text
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert choice.token_ids == _hf_greedy(folder, prompt_ids, [image])


def test_the_same_image_from_a_file_or_http_gives_the_same_answer(url, llava, image_server):
    _, _, media = llava
    by_data = _ask(url, data_url(random_image(7))).choices[0].token_ids
    by_file = _ask(url, (media / "cat.png").as_uri()).choices[0].token_ids
    by_http = _ask(url, f"{image_server}/cat.png").choices[0].token_ids
    assert by_data == by_file == by_http
    other = _ask(url, data_url(random_image(8))).choices[0].token_ids
    assert other != by_data


def test_two_images_streamed(url, llava):
    folder, image_id, _ = llava
    images = [random_image(1), random_image(2, 50, 20)]
    stream = client(url).chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(images[0])}},
                    {"type": "text", "text": "Compare <image> with the first."},
                    {"type": "image_url", "image_url": {"url": data_url(images[1])}},
                ],
            }
        ],
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    prompt_ids = chunks[0].prompt_token_ids
    tokens = [
        t
        for chunk in chunks
        for choice in chunk.choices
        for t in getattr(choice, "token_ids", None) or []
    ]
    # One placeholder was in the text; the other image's was put first.
    assert prompt_ids.count(image_id) == 32
    assert tokens == _hf_greedy(folder, prompt_ids, images)


@pytest.mark.parametrize(
    ("image_url", "status", "message"),
    [
        ("data:image/png;base64,@@@", 400, "Invalid base64 data"),
        ("data:image/png,plain", 501, "Only base64 data URLs are supported for now."),
        ("data:image/png;base64", 400, "missing ',' separator"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), 400, "cannot identify image file"),
        ("ftp://example.com/cat.png", 400, "The URL must be either a HTTP, data or file URL."),
        ("file:///etc/hostname", 400, "must be a subpath of `--allowed-local-media-path"),
    ],
)  # fmt: skip
def test_bad_images_are_refused_with_vllms_status(url, image_url, status, message):
    with pytest.raises(Exception) as caught:
        _ask(url, image_url)
    assert caught.value.status_code == status
    assert message in caught.value.body["message"]
    assert _ask(url, data_url(random_image(0))).choices[0].finish_reason == "length"


def test_files_that_are_no_images_and_missing_fetches(url, llava, image_server):
    _, _, media = llava
    with pytest.raises(Exception) as caught:
        _ask(url, (media / "notes.txt").as_uri())
    assert caught.value.status_code == 400
    with pytest.raises(Exception) as caught:
        _ask(url, f"{image_server}/missing.png")
    assert caught.value.status_code == 422
    assert "HTTP 404" in caught.value.body["message"]


def test_more_images_than_the_limit_or_the_placeholders(url):
    image = data_url(random_image(0))
    with pytest.raises(Exception) as caught:
        _ask(url, image, image, image)
    assert caught.value.status_code == 400
    assert caught.value.body["message"] == "At most 2 image(s) may be provided in one prompt."
    with pytest.raises(Exception) as caught:
        _ask(url, image, text="<image> and <image>?")
    assert caught.value.status_code == 400
    assert "more '<image>' placeholders in input prompt than actual" in caught.value.body["message"]


def test_the_openai_content_format_gives_the_template_image_parts():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        }
    ]
    as_parts = conversation(messages, True, "", "<image>")
    assert as_parts[0]["content"] == [{"type": "text", "text": "Look:"}, {"type": "image"}]
    assert conversation(messages, False, "", "<image>")[0]["content"] == "<image>\nLook:"
    with pytest.raises(APIError, match="only text content parts are supported"):
        conversation(messages, False, "", None)  # a model that takes no images


def test_a_transparent_image_is_seen_over_white(url):
    """vLLM's default image mode: RGB, a transparent image composed over white."""
    import numpy as np
    from PIL import Image

    rgb = np.asarray(random_image(5))
    alpha = np.zeros(rgb.shape[:2], dtype=np.uint8)
    alpha[:, : rgb.shape[1] // 2] = 255  # the left half opaque, the right half clear
    rgba = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    over_white = rgb.copy()
    over_white[:, rgb.shape[1] // 2 :] = 255
    by_rgba = _ask(url, data_url(rgba)).choices[0].token_ids
    assert by_rgba == _ask(url, data_url(Image.fromarray(over_white))).choices[0].token_ids
    assert by_rgba != _ask(url, data_url(Image.fromarray(rgb))).choices[0].token_ids


def test_responses_and_anthropic_messages_take_images_as_chat_does(url):
    """/v1/responses' input_image part and /v1/messages' image block (base64 source) give
    the chat answer of the same image and question."""
    import anthropic

    image = random_image(7)
    chat = client(url).chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                ],
            }
        ],
        max_tokens=NEW_TOKENS,
        temperature=0,
    )
    response = client(url).responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                ],
            }
        ],
        max_output_tokens=NEW_TOKENS,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    source = {
        "type": "base64",
        "media_type": "image/png",
        "data": base64.b64encode(png_bytes(image)).decode(),
    }
    message = anthropic.Anthropic(base_url=url, api_key="unused").messages.create(
        model=MODEL,
        max_tokens=NEW_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image", "source": source},
                ],
            }
        ],
    )
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_tokenize_counts_an_images_rows_as_chat_does(url):
    from tests.server.openai_helpers import post

    content = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": data_url(random_image(7))}},
    ]
    tokenized = post(
        url, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    )
    assert tokenized.status == 200
    chat = _ask(url, data_url(random_image(7)))
    assert tokenized.json()["tokens"] == chat.prompt_token_ids


def test_rendering_a_prompt_with_images_is_refused_by_name(llava, server_loop):
    """vLLM's scale-out render writes an image's processed features into its
    GenerateRequest; aioserve does not yet, and says so."""
    from tests.server.openai_helpers import post

    folder, _, _ = llava
    engine = AsyncEngine.from_config(
        engine_config_from_kwargs(
            model=folder, dtype="float32", max_model_len=128, enforce_eager=True
        )
    )
    try:
        from tests.server.conftest import serve_built

        with serve_built(server_loop, engine, "--enable-scale-out") as base:
            content = [
                {"type": "text", "text": QUESTION},
                {"type": "image_url", "image_url": {"url": data_url(random_image(0))}},
            ]
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            reply = post(base, "/v1/chat/completions/render", body)
            assert reply.status == 501
            assert "rendering prompts with images" in reply.json()["error"]["message"]
            del body["messages"][0]["content"][1]
            assert post(base, "/v1/chat/completions/render", body).status == 200
    finally:
        server_loop.run(engine.shutdown())
