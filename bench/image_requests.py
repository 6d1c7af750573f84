"""Chat-shaped requests with one image each: aioserve's offline engine against transformers'
LlavaForConditionalGeneration.generate, on the same random weights, in one process.

Builds (once, under --folder) a LLaVA of LLaVA-1.5's vision side (CLIP ViT-L/14 at 336
pixels: 24 layers of 1024, 576 image rows, the second-to-last layer's features) before a
decoder of SmolLM2-135M's shape with SmolLM2's tokenizer and an "<image>" token, then runs
--num-prompts prompts (a question of ~20 tokens and one random image each, --output-len
tokens greedy with ignore_eos) through both: aioserve all at once (its engine batches
them), transformers one by one and then as one padded batch. Prints seconds and output
tokens/s of each, alternated --rounds times, and aioserve's time to first token at one
request (the image's encoding plus the prefill of its 600 tokens).

    python bench/image_requests.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.transformers_backend import smollm2_shaped_config  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/aioserve-bench-llava-shaped")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    return parser.parse_args()


def llava_shaped_folder(folder: Path) -> str:
    if (folder / "config.json").is_file():
        return str(folder)
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from aioserve.models.checkpoint import open_checkpoint
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    tokenizer = open_checkpoint(str(resolve_model(DEFAULT_MODEL).path)).load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    )
    text = smollm2_shaped_config(len(tokenizer))
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        architectures=["LlavaForConditionalGeneration"],
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    CLIPImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
    ).save_pretrained(folder)
    return str(folder)


def images(count: int) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(count)
    ]


QUESTION = "USER: <image>\nWhat is shown in this image? Describe it in a few words. ASSISTANT:"


def run_aioserve(llm, pictures: list, output_len: int) -> tuple[float, int]:
    from aioserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompts = [{"prompt": QUESTION, "multi_modal_data": {"image": p}} for p in pictures]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_transformers(model, processor, pictures: list, output_len: int, batched: bool):
    import torch

    started = time.perf_counter()
    tokens = 0
    groups = [pictures] if batched else [[p] for p in pictures]
    with torch.inference_mode():
        for group in groups:
            inputs = processor(
                text=[QUESTION] * len(group), images=group, return_tensors="pt", padding=True
            )
            inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
            out = model.generate(
                **inputs, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False
            )
            tokens += (out.shape[1] - inputs["input_ids"].shape[1]) * len(group)
    return time.perf_counter() - started, tokens


def main() -> None:
    args = parse_args()
    import torch
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    from aioserve import LLM, SamplingParams

    folder = llava_shaped_folder(Path(args.folder))
    dtype = getattr(torch, args.dtype)
    pictures = images(args.num_prompts)
    llm = LLM(model=folder, dtype=args.dtype, max_model_len=2048)
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    processor = LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(folder),
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class row (llava-hf's processor config)
    )
    run_aioserve(llm, pictures[:1], 2)  # warm: the compiled step's shapes
    results: dict[str, list[float]] = {"aioserve": [], "hf_one_by_one": [], "hf_batched": []}
    for round_ in range(args.rounds):
        for name in results:
            if name == "aioserve":
                elapsed, tokens = run_aioserve(llm, pictures, args.output_len)
            else:
                batched = name == "hf_batched"
                elapsed, tokens = run_transformers(
                    hf, processor, pictures, args.output_len, batched
                )
            results[name].append(tokens / elapsed)
            print(f"round {round_} {name}: {elapsed:.2f} s, {tokens / elapsed:.1f} output tok/s")
    one = SamplingParams(temperature=0, max_tokens=1)
    ttfts = []
    for picture in pictures[:3]:
        started = time.perf_counter()
        llm.generate(
            {"prompt": QUESTION, "multi_modal_data": {"image": picture}}, one, use_tqdm=False
        )
        ttfts.append(time.perf_counter() - started)
    llm.close()
    medians = {name: statistics.median(values) for name, values in results.items()}
    for name, value in medians.items():
        print(f"median {name}: {value:.1f} output tok/s")
    print(
        f"aioserve / transformers one by one: {medians['aioserve'] / medians['hf_one_by_one']:.2f}x; "
        f"/ transformers batched: {medians['aioserve'] / medians['hf_batched']:.2f}x"
    )
    print(f"aioserve, one request's first token: median {statistics.median(ttfts):.2f} s")


if __name__ == "__main__":
    main()
