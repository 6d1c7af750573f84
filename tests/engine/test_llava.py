"""Image inputs (engine/multimodal.py, models/llava.py, models/vision_encoders.py) against
transformers' LlavaForConditionalGeneration on the same random weights, float32: the
towers' features, then greedy tokens and their logprobs through the whole engine, with
images cut across prefill chunks and taken from the prefix cache; and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aioserve import LLM, SamplingParams
from aioserve.engine.admission import InvalidRequest
from tests.models.llava_folders import IMAGE_SIZE, TOWERS, random_image, write_tiny_llava

NEW_TOKENS = 8
ROWS_PER_IMAGE = (IMAGE_SIZE // 7) ** 2  # the CLIP row dropped, SigLIP's none
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def llava_folders(smollm2_gguf, tmp_path_factory) -> dict[str, tuple[str, int]]:
    from aioserve.models.checkpoint import open_checkpoint

    folders = {}
    for tower in TOWERS:
        tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
        folder = tmp_path_factory.mktemp(f"llava_{tower}")
        folders[tower] = (str(folder), write_tiny_llava(folder, tokenizer, tower))
    return folders


@pytest.fixture(scope="module")
def hf_models(llava_folders):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    return {
        tower: (
            LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval(),
            AutoImageProcessor.from_pretrained(folder),
        )
        for tower, (folder, _) in llava_folders.items()
    }


def _hf_greedy(hf, prompt: list[int], images: list, image_id: int):
    """transformers' greedy tokens and logprobs, its processor making the pixels and the
    prompt's placeholders widened as its LlavaProcessor widens them."""
    model, processor = hf
    ids = []
    for token in prompt:
        ids.extend([token] * (ROWS_PER_IMAGE if token == image_id else 1))
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    ids = torch.tensor([ids])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, pixel_values=pixels).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def _prompts(image_id: int) -> list[tuple[list[int], list]]:
    return [
        ([1, 2000, image_id, 300, 44, 5, 60], [random_image(0)]),
        (
            [504, image_id, 3575, 282, image_id, 77, 9, 11],
            [random_image(1), random_image(2, 28, 50)],
        ),
    ]


def _assert_matches(hf, outputs, cases, image_id) -> None:
    for (prompt, images), output in zip(cases, outputs, strict=True):
        want_tokens, want_logprobs = _hf_greedy(hf, prompt, images, image_id)
        got = output.outputs[0]
        assert list(got.token_ids) == want_tokens
        assert len(set(want_tokens)) > 2  # not one token over and over
        logprobs = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.parametrize("tower", list(TOWERS))
def test_image_features_equal_transformers(tower, llava_folders, hf_models):
    from aioserve.models.checkpoint import open_checkpoint
    from aioserve.models.loader import load_model

    folder, _ = llava_folders[tower]
    ours = load_model(
        open_checkpoint(folder), dtype=torch.float32, device=torch.device("cpu"), use_tqdm=False
    )
    model, _ = hf_models[tower]
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    config = model.config
    with torch.no_grad():
        want = model.model.get_image_features(
            pixels,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
        ).pooler_output
        got = [ours.image_features(p) for p in pixels]
    assert ours.num_image_tokens == ROWS_PER_IMAGE
    for mine, theirs in zip(got, want, strict=True):
        assert mine.shape == (ROWS_PER_IMAGE, 64)
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tower", list(TOWERS))
def test_greedy_answers_about_images_match_transformers(tower, llava_folders, hf_models):
    folder, image_id = llava_folders[tower]
    cases = _prompts(image_id)
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=128)
    try:
        outputs = llm.generate(
            [{"prompt_token_ids": p, "multi_modal_data": {"image": i}} for p, i in cases],
            GREEDY,
            use_tqdm=False,
        )
    finally:
        llm.close()
    for (prompt, _), output in zip(cases, outputs, strict=True):
        assert len(output.prompt_token_ids) == len(prompt) + prompt.count(image_id) * (
            ROWS_PER_IMAGE - 1
        )
    _assert_matches(hf_models[tower], outputs, cases, image_id)


def test_images_cut_across_chunks_and_told_apart_by_the_prefix_cache(llava_folders, hf_models):
    """Prefill chunks of 8 tokens cut each image's 16 rows; then the same tokens with
    another image must not take the first image's cached blocks, and the first image again
    must take them."""
    folder, image_id = llava_folders["clip"]
    prompt = [1, 2000, 300, 44, 5, 60, 70, 800, image_id, 9000, 10, 11, 12, 13, 14, 15, 16, 17]
    first, other = [random_image(3)], [random_image(4)]
    options = dict(max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=2)
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=128, **options)
    try:
        outputs = [
            llm.generate(
                [{"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}],
                GREEDY,
                use_tqdm=False,
            )[0]
            for images in (first, other, first)
        ]
    finally:
        llm.close()
    cases = [(prompt, first), (prompt, other), (prompt, first)]
    _assert_matches(hf_models["clip"], outputs, cases, image_id)
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    # The blocks before the image are shared by all three; past it, only the third's.
    assert outputs[1].num_cached_tokens == 8
    assert outputs[2].num_cached_tokens >= 24


def test_refusals(llava_folders):
    folder, image_id = llava_folders["clip"]
    llm = LLM(
        model=folder,
        dtype="float32",
        block_size=8,
        max_model_len=64,
        limit_mm_per_prompt={"image": 1},
    )
    prompt = [1, image_id, 5]

    def refusal(multi_modal_data, token_ids=prompt) -> str:
        with pytest.raises(InvalidRequest) as caught:
            llm.generate(
                {"prompt_token_ids": token_ids, "multi_modal_data": multi_modal_data},
                GREEDY,
                use_tqdm=False,
            )
        return str(caught.value)

    try:
        assert refusal({"image": [random_image(0), random_image(1)]}) == (
            "At most 1 image(s) may be provided in one prompt."
        )
        assert "1 image placeholder(s) for 0 image(s)" in refusal({"image": []})
        assert "'video' is not supported" in refusal({"video": [random_image(0)]})
        assert "PIL.Image.Image, got ndarray" in refusal({"image": [np.zeros((4, 4, 3))]})
        three = [1, image_id, image_id, image_id, 5]
        assert "run of 3 image placeholder tokens" in refusal({"image": [random_image(0)]}, three)
        # The prompt's widened length counts against max_model_len (16 rows an image).
        long = [1, *range(100, 150), image_id]
        assert "your prompt contains 67 input tokens" in refusal({"image": [random_image(0)]}, long)
        # A prompt already widened (as transformers' processor widens it) is taken as it is.
        widened = [1, *[image_id] * ROWS_PER_IMAGE, 5]
        out = llm.generate(
            {"prompt_token_ids": widened, "multi_modal_data": {"image": random_image(0)}},
            GREEDY,
            use_tqdm=False,
        )[0]
        assert len(out.prompt_token_ids) == len(widened)
        # And nothing was left holding blocks.
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    finally:
        llm.close()


def test_a_beam_search_of_width_one_sees_the_image_each_step(llava_folders, hf_models):
    """Each step of a search is a request of its own: every one must carry the image
    (encoded once), or the search would drift from the greedy answer."""
    from aioserve.engine.beam_search import BeamSearchParams

    folder, image_id = llava_folders["clip"]
    prompt, images = _prompts(image_id)[0]
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=128)
    try:
        [output] = llm.beam_search(
            [{"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}],
            BeamSearchParams(beam_width=1, max_tokens=NEW_TOKENS, ignore_eos=True),
        )
    finally:
        llm.close()
    want, _ = _hf_greedy(hf_models["clip"], prompt, images, image_id)
    widened = len(prompt) + ROWS_PER_IMAGE - 1
    assert output.sequences[0].tokens[widened:] == want


def test_llm_chat_refuses_image_parts_it_would_not_read(llava_folders):
    folder, _ = llava_folders["clip"]
    llm = LLM(model=folder, dtype="float32", block_size=8, max_model_len=64)
    try:
        message = {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
        }
        with pytest.raises(ValueError, match="LLM.chat takes text content parts only"):
            llm.chat([message], GREEDY, use_tqdm=False)
    finally:
        llm.close()
