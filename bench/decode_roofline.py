"""One stream's decode speed against the memory roofline: ms a token, and the bytes of weights
each token reads over that time, beside the device's peak and measured copy bandwidth.

At batch 1 a decode step reads every weight once, so its floor is the weights' bytes over
the memory bandwidth. The offline engine generates from one prompt of --context random
token ids, twice: one token, then 1 + --tokens tokens; the difference over --tokens is the
time of a decode step (prefill and start-up cancel out), the median of --repeats pairs.

    python bench/decode_roofline.py --model bench/gpu_model_llama3_8b   # Llama-3-8B shape
    python bench/decode_roofline.py --model bench/gpu_model --tokens 32  # SmolLM2-135M shape

The model folder needs only its config.json: weights are random (--load-format dummy) and
no tokenizer is loaded. Bytes read a token: the weights as held, less the input embedding
table when the output head has its own (only one row of it is read); where one-row
products read narrower copies of the weights (the CPU under --dtype auto), those copies
instead. The peak is the vendor's figure for the device named (a table below; --peak-gbps
overrides it), the copy rate a device-to-device copy of --copy-mib MiB measured here.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from aioserve import LLM, SamplingParams

# Vendor HBM bandwidth in GB/s, by a part of torch.cuda.get_device_name().
PEAK_GBPS = {
    "H200": 4800,
    "H100 NVL": 3900,
    "H100 PCIe": 2000,
    "H100": 3350,  # SXM5, HBM3 ("NVIDIA H100 80GB HBM3")
    "A100-SXM4-80GB": 2039,
    "A100-SXM4-40GB": 1555,
    "A100-PCIE-80GB": 1935,
    "MI300X": 5300,
    "MI325X": 6000,
    "MI250X": 3277,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/gpu_model_llama3_8b")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=128, help="decode steps timed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--peak-gbps", type=float, help="the device's memory bandwidth")
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--enforce-eager", action="store_true")
    return parser.parse_args()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"


def vendor_peak(name: str) -> float | None:
    for part, gbps in PEAK_GBPS.items():
        if part in name:
            return float(gbps)
    return None


def copy_gbps(device: torch.device, mib: int) -> float:
    """Bytes read plus written per second by a device-to-device copy, the median of 5."""
    source = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(times[1:]) / 1e9


def bytes_read_per_token(llm: LLM) -> int:
    """What one decode step's products read (see the module docstring)."""
    report = llm.engine.settings.load_report
    if report.row_copy_bytes:
        return report.row_copy_bytes
    model = llm.engine.runner.model
    if model.tie_word_embeddings:
        return report.weight_bytes
    return report.weight_bytes - model.embed_tokens.weight.nbytes


def timed_generation(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def random_weight_llm(
    model: str, dtype: str, max_model_len: int, enforce_eager: bool = False
) -> LLM:
    """The offline engine on `model`'s config with random weights and no tokenizer."""
    return LLM(
        model=model,
        load_format="dummy",
        dtype=dtype,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        seed=0,
    )


def main() -> None:
    args = parse_args()
    llm = random_weight_llm(args.model, args.dtype, args.max_model_len, args.enforce_eager)
    model = llm.engine.runner.model
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = [random.Random(0).randrange(vocab) for _ in range(args.context)]
    timed_generation(llm, prompt, 2)  # warm-up
    steps = []
    for _ in range(args.repeats):
        first = timed_generation(llm, prompt, 1)
        more = timed_generation(llm, prompt, 1 + args.tokens)
        steps.append((more - first) / args.tokens)
    step = statistics.median(steps)
    read = bytes_read_per_token(llm)
    name = device_name(device)
    peak = args.peak_gbps or vendor_peak(name)
    copy = copy_gbps(device, args.copy_mib)
    achieved = read / step / 1e9
    print(f"device: {name}; model {args.model}, {read / 1e9:.3f} GB of weights read a token")
    print(
        f"decode at batch 1: {step * 1e3:.3f} ms/token (steps of {args.tokens} tokens, "
        f"median of {args.repeats}: {', '.join(f'{s * 1e3:.3f}' for s in steps)})"
    )
    print(
        f"achieved: {achieved:.1f} GB/s; copy: {copy:.1f} GB/s "
        f"({100 * achieved / copy:.0f}% of it, floor {read / copy / 1e6:.3f} ms)"
    )
    if peak is None:
        print("peak: unknown for this device (--peak-gbps)")
    else:
        print(
            f"peak: {peak:.0f} GB/s ({100 * achieved / peak:.0f}% of it, "
            f"floor {read / peak / 1e6:.3f} ms)"
        )
    llm.close()


if __name__ == "__main__":
    main()
