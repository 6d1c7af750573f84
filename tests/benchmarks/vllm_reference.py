"""What vLLM's own benchmark functions give on the inputs of test_vllm_rules.py.

Run by that test with the python of a local vLLM install (when there is one), as
`python vllm_reference.py INPUT.json`; prints one JSON object. Not collected by pytest.
"""

import contextlib
import io
import json
import sys


def main(spec: dict) -> dict:
    from vllm.benchmarks.datasets.datasets import (
        BenchmarkDataset,
        CustomDataset,
        SampleRequest,
        _parse_range_ratio,
    )
    from vllm.benchmarks.datasets.utils import get_sampling_params
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics, check_goodput_args

    out: dict = {}
    outputs = [RequestFuncOutput(**fields) for fields in spec["outputs"]]
    out["metrics"] = []
    for goodput in spec["goodputs"]:
        with contextlib.redirect_stdout(io.StringIO()):
            metrics, _ = calculate_metrics([], outputs, spec["duration"], None, [99], goodput)
        out["metrics"].append(
            {
                "max_concurrent_requests": metrics.max_concurrent_requests,
                "request_goodput": metrics.request_goodput,
            }
        )
    out["goodput_errors"] = []
    for pairs in spec["bad_goodputs"]:

        class Args:
            goodput = pairs

        try:
            check_goodput_args(Args)
            out["goodput_errors"].append(None)
        except Exception as error:  # noqa: BLE001 - the message is what is compared
            out["goodput_errors"].append(str(error))

    class Plain(BenchmarkDataset):
        def load_data(self):
            pass

        def sample(self, *args, **kwargs):
            return []

    dataset = Plain(random_seed=spec["seed"])
    requests = [
        SampleRequest(prompt=str(i), prompt_len=i, expected_output_len=1, request_id=str(i))
        for i in range(spec["oversample_from"])
    ]
    dataset.maybe_oversample_requests(requests, spec["oversample_to"])
    out["oversampled"] = [r.prompt_len for r in requests]

    import numpy as np
    import pandas as pd

    frame = pd.DataFrame({"row": list(range(spec["burst_rows"]))})
    out["burst"] = {
        str(n): frame.sample(n=n, random_state=spec["seed"], replace=n > len(frame))["row"].tolist()
        for n in spec["burst_draws"]
    }

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    input_lens, output_lens, _ = get_sampling_params(
        np.random.default_rng(spec["seed"]),
        spec["random_count"],
        _parse_range_ratio(spec["range_ratio"]),
        spec["random_input_len"],
        spec["random_output_len"],
        tokenizer,
    )
    out["random_lens"] = [input_lens.tolist(), output_lens.tolist()]

    custom = []
    for skip in (False, True):
        data = CustomDataset(dataset_path=spec["custom_path"], random_seed=spec["seed"])
        samples = data.sample(
            tokenizer=tokenizer,
            num_requests=spec["custom_count"],
            output_len=spec["custom_output_len"],
            skip_chat_template=skip,
        )
        custom.append([[s.prompt, s.prompt_len, s.expected_output_len] for s in samples])
    out["custom"] = custom
    return out


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as file:
        result = main(json.load(file))
    print("VLLM-REFERENCE " + json.dumps(result))
