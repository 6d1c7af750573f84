"""The `hf` backend of `bench throughput`: transformers' own batched `generate` as the peer.

The same model files and dtype as aioserve would use, the same sampling (temperature 1,
top-p 1, EOS ignored so every request gets exactly its output length). Requests are
batched in order, up to `max_batch_size` at a time; a batch holds requests of one output
length only, so no request generates more tokens than it asks for and the token counts
are exact. Prompts in a batch are left-padded; the padding is transformers' cost, not
counted as tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from aioserve.benchmarks.datasets import SampleRequest
from aioserve.engine.resolution import resolve_dtype
from aioserve.models.checkpoint import Checkpoint
from aioserve.platform import device


def load_transformers_model(checkpoint: Checkpoint, dtype: str = "auto") -> PreTrainedModel:
    """The checkpoint's model in transformers, in the dtype aioserve resolves `dtype` to."""
    source = checkpoint.source
    options = {"dtype": resolve_dtype(dtype, checkpoint)}
    if source.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(
            source.path.parent, gguf_file=source.path.name, **options
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, **options)
    return model.to(device()).eval()


def _batches(requests: Sequence[SampleRequest], max_batch_size: int):
    """Runs of consecutive requests with one output length, cut at `max_batch_size`."""
    for _, same_length in itertools.groupby(requests, key=lambda r: r.expected_output_len):
        group = list(same_length)
        for start in range(0, len(group), max_batch_size):
            yield group[start : start + max_batch_size]


@torch.inference_mode()
def run_transformers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[SampleRequest],
    *,
    n: int = 1,
    max_batch_size: int,
    disable_detokenize: bool = False,
    show_progress: bool = True,
) -> float:
    """Generate every request's output with `model.generate`; return the seconds it took.

    Each request gets n samples of exactly its expected output length.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dev = next(model.parameters()).device
    bar = tqdm(total=len(requests), desc="Processed prompts", disable=not show_progress)
    start = time.perf_counter()
    for batch in _batches(requests, max_batch_size):
        prompts = [tokenizer(r.prompt).input_ids for r in batch]
        width = max(len(ids) for ids in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        output_len = batch[0].expected_output_len
        out = model.generate(
            input_ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            num_return_sequences=n,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad_id,
        )
        if out.shape[1] != width + output_len:
            raise RuntimeError(
                f"transformers generated {out.shape[1] - width} tokens instead of {output_len}"
            )
        if not disable_detokenize:
            tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        bar.update(len(batch))
    elapsed = time.perf_counter() - start
    bar.close()
    return elapsed
