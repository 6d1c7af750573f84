"""vLLM's ParallelConfig arguments. aioserve runs the model on one device, in the server's
own process: the parallel sizes are taken at 1 and the `uni` executor (values.one_process),
every other value and the data/expert-parallel arguments refused by name. Declared here
(and spliced into `arguments.ARGUMENTS` where the group stands) to keep arguments.py small.
"""

from __future__ import annotations

from aioserve.config import values
from aioserve.config.declaration import PARALLEL, Argument, vllm_only

# fmt: off
PARALLEL_ARGUMENTS: tuple[Argument, ...] = (
    Argument("distributed-executor-backend", PARALLEL, None,
             "How worker processes are launched. aioserve runs the model in the server's own "
             "process, vLLM's uni executor (what vLLM picks for one device): uni is accepted, "
             "the backends that launch workers are refused.",
             convert=values.string, choices=("uni",), vllm_choices=("ray", "mp", "external_launcher"),
             choice_noun="executor backend"),
    Argument("pipeline-parallel-size", PARALLEL, 1,
             "Pipeline stages. aioserve runs every layer on one device: 1 only.",
             aliases=("-pp",), convert=values.one_process("pipeline parallelism")),
    Argument("tensor-parallel-size", PARALLEL, 1,
             "Devices each layer is sharded across. aioserve runs on one device: 1 only.",
             aliases=("-tp",), convert=values.one_process("tensor parallelism")),
    Argument("data-parallel-size", PARALLEL, 1,
             "Data-parallel engine replicas. aioserve runs one engine: 1 only.",
             aliases=("-dp",), convert=values.one_process("data parallelism")),
    vllm_only("data-parallel-rank", PARALLEL, None, "Data-parallel rank of this instance.", aliases=("-dpn",)),
    vllm_only("data-parallel-start-rank", PARALLEL, None, "First data-parallel rank on a secondary node.",
          aliases=("-dpr",)),
    vllm_only("data-parallel-size-local", PARALLEL, None, "Data-parallel replicas on this node.",
          aliases=("-dpl",)),
    vllm_only("data-parallel-address", PARALLEL, None, "Address of the data-parallel head node.",
          aliases=("-dpa",)),
    vllm_only("data-parallel-rpc-port", PARALLEL, None, "RPC port for data-parallel coordination.",
          aliases=("-dpp",)),
    vllm_only("data-parallel-backend", PARALLEL, "mp", "How data-parallel replicas are launched.",
          choices=("mp", "ray"), aliases=("-dpb",)),
    vllm_only("data-parallel-hybrid-lb", PARALLEL, False,
          "Balance load inside each node, with an external balancer across nodes.", "bool",
          aliases=("-dph",)),
    vllm_only("enable-expert-parallel", PARALLEL, False, "Shard MoE experts with expert parallelism.", "bool",
          aliases=("-ep",)),
    vllm_only("enable-eplb", PARALLEL, False, "Balance MoE experts across ranks at run time.", "bool"),
    vllm_only("eplb-config", PARALLEL,
          {"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0,
           "log_balancedness": False},
          "Expert load-balancing settings.", "json"),
    vllm_only("num-redundant-experts", PARALLEL, None, "Deprecated in vLLM (use --eplb-config)."),
    vllm_only("eplb-window-size", PARALLEL, None, "Deprecated in vLLM (use --eplb-config)."),
    vllm_only("eplb-step-interval", PARALLEL, None, "Deprecated in vLLM (use --eplb-config)."),
    vllm_only("eplb-log-balancedness", PARALLEL, None, "Deprecated in vLLM (use --eplb-config).", "bool"),
    vllm_only("max-parallel-loading-workers", PARALLEL, None,
          "Load weights in this many sequential batches to save host memory."),
    vllm_only("ray-workers-use-nsight", PARALLEL, False, "Profile Ray workers with Nsight.", "bool"),
    vllm_only("disable-custom-all-reduce", PARALLEL, False, "Use the library all-reduce only.", "bool"),
    vllm_only("worker-cls", PARALLEL, "auto", "Worker class."),
    vllm_only("worker-extension-cls", PARALLEL, "", "Mixin class added to the worker."),
    vllm_only("enable-multimodal-encoder-data-parallel", PARALLEL, False,
          "Run the vision encoder data-parallel across tensor-parallel ranks.", "flag"),
    vllm_only("worker-use-ray", PARALLEL, False,
          "Deprecated in vLLM (use --distributed-executor-backend=ray).", "flag"),
)
# fmt: on
