"""Where one stream's decode step goes on a GPU: the captured forward pass, its dense layers
alone, the output head and the sampler, each timed on the device.

    python bench/decode_parts.py --model bench/gpu_model_llama3_8b   # Llama-3-8B shape

The engine is built as decode_roofline.py builds it (random weights, bf16, decode graphs
captured); run it as a script, from the repository root. Each part is replayed or run --iters times between two CUDA events:

- forward: the batch-1 decode graph, over a context of --context tokens;
- dense layers: every layer's four products at one row (qkv, o, gate_up, down), captured
  in a graph of their own, so the rest of the forward (norms, rotary, the KV write,
  attention, SiLU) is the difference;
- head and sampler: the output head over one row and the greedy sampler, run eagerly as
  the runner runs them.

Bytes are the weights each part reads; GB/s is over the part's time. It needs a GPU.
"""

from __future__ import annotations

import argparse

import torch
from decode_roofline import random_weight_llm  # this script's folder is on sys.path

from aioserve import SamplingParams
from aioserve.kernels.sampling import make_sampling_batch, sample


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/gpu_model_llama3_8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    return parser.parse_args()


def device_ms(fn, iters: int) -> float:
    """Mean device time of `fn()` over `iters` calls after a warm-up call."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def dense_layers_graph(model: torch.nn.Module, dtype: torch.dtype) -> torch.cuda.CUDAGraph:
    """A graph of every layer's four products at one row."""
    layer = model.layers[0]
    hidden = torch.randn(1, layer.self_attn.o_proj.weight.shape[0], dtype=dtype, device="cuda")
    inner = torch.randn(1, layer.mlp.down_proj.weight.shape[1], dtype=dtype, device="cuda")
    attn = torch.randn(1, layer.self_attn.o_proj.weight.shape[1], dtype=dtype, device="cuda")

    def products() -> None:
        for layer in model.layers:
            layer.self_attn.qkv_proj(hidden)
            layer.self_attn.o_proj(attn)
            layer.mlp.gate_up_proj(hidden)
            layer.mlp.down_proj(inner)

    products()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        products()
    return graph


def main() -> None:
    args = parse_args()
    llm = random_weight_llm(args.model, args.dtype, max(2048, args.context + 1))
    runner = llm.engine.runner
    model = runner.model
    if runner.decode_graphs is None or 1 not in runner.decode_graphs.graphs:
        raise SystemExit("no batch-1 decode graph: this needs a GPU and no --enforce-eager")
    # A real context for the graph to read: one sequence of --context tokens decoded.
    prompt = list(range(1, args.context))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    graphs = runner.decode_graphs
    blocks = -(-args.context // runner.block_size)
    graphs.seq_lens[0] = args.context
    graphs.block_tables[0, :blocks] = torch.arange(blocks, dtype=torch.int32)
    graphs.slot_mapping[0] = -1  # read the context, write nothing
    graphs.positions[0] = args.context - 1
    forward = graphs.graphs[1]
    dense = dense_layers_graph(model, model.embed_tokens.weight.dtype)
    hidden = graphs.outputs[1][:1]
    batch = make_sampling_batch(1, device=runner.device, temperature=0.0)

    def head_and_sampler() -> None:
        sample(runner.model_step.logits(hidden), batch)

    parts = {
        "forward (graph)": (
            device_ms(forward.replay, args.iters),
            _layer_bytes(model, all_of=True),
        ),
        "dense layers (graph)": (device_ms(dense.replay, args.iters), _layer_bytes(model)),
        "head + greedy sampler": (device_ms(head_and_sampler, args.iters), _head_bytes(model)),
    }
    forward_ms, forward_bytes = parts["forward (graph)"]
    dense_ms, dense_bytes = parts["dense layers (graph)"]
    parts["rest of the forward"] = (forward_ms - dense_ms, forward_bytes - dense_bytes)
    print(f"device: {torch.cuda.get_device_name()}; model {args.model}, context {args.context}")
    print("| part | ms | GB read | GB/s |")
    print("|---|---|---|---|")
    for name, (ms, read) in parts.items():
        print(f"| {name} | {ms:.3f} | {read / 1e9:.3f} | {read / ms / 1e6:.0f} |")
    llm.close()


def _layer_bytes(model: torch.nn.Module, all_of: bool = False) -> int:
    """The dense layers' weights (with the norms' too when `all_of`)."""
    total = 0
    for name, param in model.layers.named_parameters():
        if all_of or name.endswith("proj.weight"):
            total += param.nbytes
    return total


def _head_bytes(model: torch.nn.Module) -> int:
    head = model.embed_tokens.weight if model.tie_word_embeddings else model.lm_head.weight
    return head.nbytes + model.norm.weight.nbytes


if __name__ == "__main__":
    main()
