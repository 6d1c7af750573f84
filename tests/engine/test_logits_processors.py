"""--logits-processors end to end on a tiny Llama, against transformers' own greedy loop
with the same rules written as transformers LogitsProcessors.

Two processors: `NoRepeat` (vLLM's adapter over a per-request function: never the token
sampled last, never the tokens in extra_args["banned"], never a prompt token with
extra_args["no_prompt_tokens"]) and `ForceToken` (a batch processor keeping its own
per-index state from the updates: only extra_args["target_token"]). Requests of several
lengths run five at a time over two sequences' worth of KV blocks with prompts chunked, so
sequences join, leave, skip steps and are preempted; every request's tokens must be
transformers' under the same rules, and a request no rule touches gives plain greedy's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import LogitsProcessor as HFLogitsProcessor

from aioserve import LLM, SamplingParams
from aioserve.config.declaration import ConfigError
from aioserve.engine.admission import InvalidRequest
from tests.engine.example_processors import NoRepeat
from tests.models.tiny_models import save_tiny_model, tiny_llama_config

NEW_TOKENS = 12


class SameRules(HFLogitsProcessor):
    """NoRepeat and ForceToken's rules for one transformers sequence."""

    def __init__(self, prompt_len: int, args: dict):
        self.prompt_len, self.args = prompt_len, args

    def __call__(self, input_ids, scores):
        prompt, output = input_ids[0, : self.prompt_len], input_ids[0, self.prompt_len :]
        if self.args.get("no_prompt_tokens"):
            scores[0, prompt] = float("-inf")
        if self.args.get("no_repeat") and len(output):
            scores[0, output[-1]] = float("-inf")
        scores[0, list(self.args.get("banned", ()))] = float("-inf")
        if "target_token" in self.args:
            kept = scores[0, self.args["target_token"]].clone()
            scores[0] = float("-inf")
            scores[0, self.args["target_token"]] = kept
        return scores


PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate((37, 9, 21, 44, 5, 30, 17))]
ARGS = [
    {"no_repeat": True},
    None,
    {"banned": [7, 8, 9, 100]},
    {"target_token": 42},
    {"no_prompt_tokens": True, "no_repeat": True},
    {"no_repeat": True, "banned": [1]},
    None,
]


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_tiny_model(tiny_llama_config(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(llama_folder) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    expected = []
    for prompt, args in zip(PROMPTS, ARGS, strict=True):
        rules = [SameRules(len(prompt), args)] if args else []
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            logits_processor=rules,
            pad_token_id=0,
        )
        expected.append(out[0, len(prompt) :].tolist())
    return expected


def _llm(folder, **more) -> LLM:
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        max_num_seqs=5,
        max_num_batched_tokens=32,  # prompts chunked beside decodes
        num_gpu_blocks_override=8,  # two sequences' worth: preemptions
        skip_tokenizer_init=True,
        enforce_eager=True,
        logits_processors=[NoRepeat, "tests.engine.example_processors:ForceToken"],
        **more,
    )


def _params(args: dict | None, **more) -> SamplingParams:
    return SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, extra_args=args, **more
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_request_gets_transformers_tokens_under_the_same_rules(
    llama_folder, expected, async_scheduling
):
    with _llm(llama_folder, async_scheduling=async_scheduling) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            [_params(args) for args in ARGS],
            use_tqdm=False,
        )
        assert llm.engine.scheduler.stats.num_preemptions > 0
    got = [o.outputs[0].token_ids for o in outputs]
    for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
        assert tokens == want, (i, ARGS[i])
    assert got[3] == [42] * NEW_TOKENS
    assert all(a != b for a, b in zip(got[0], got[0][1:], strict=False))


def test_raw_logprobs_report_the_logits_before_any_processor(llama_folder, expected):
    model = AutoModelForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    prompt, forced = PROMPTS[3], expected[3]
    with _llm(llama_folder) as llm:
        [output] = llm.generate(
            [{"prompt_token_ids": prompt}], [_params(ARGS[3], logprobs=0)], use_tqdm=False
        )
    with torch.no_grad():
        logits = model(torch.tensor([prompt + forced])).logits[0].float()
    raw = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)[:, 42]
    sample = output.outputs[0]
    assert sample.token_ids == forced
    got = [entry[42].logprob for entry in sample.logprobs]
    assert got == pytest.approx(raw.tolist(), abs=1e-4)
    assert max(got) < -1.0  # not the forced row's 0


def test_a_processor_refuses_a_request_by_its_parameters(llama_folder):
    with _llm(llama_folder) as llm:
        with pytest.raises(InvalidRequest, match="target_token must be an integer") as refused:
            llm.generate(
                [{"prompt_token_ids": [5, 6, 7]}], _params({"target_token": "x"}), use_tqdm=False
            )
        assert refused.value.param == "extra_args"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("tests.engine.example_processors.ForceToken", "is not '<module>:<class>'"),
        ("tests.engine.no_such_module:Processor", "cannot load 'tests.engine.no_such_module"),
        ("tests.engine.example_processors:Missing", "cannot load .*AttributeError"),
        ("tests.engine.test_logits_processors:SameRules", "not a subclass of aioserve"),
    ],
)
def test_bad_entries_are_refused_naming_the_flag(llama_folder, entry, message):
    with pytest.raises((ValueError, ConfigError), match=message) as refused:
        LLM(model=str(llama_folder), skip_tokenizer_init=True, logits_processors=[entry])
    assert "logits-processors" in str(refused.value) or "logits_processors" in str(refused.value)


def test_speculative_decoding_is_refused_beside_processors(llama_folder):
    with pytest.raises(ConfigError, match="not supported when speculative decoding"):
        LLM(
            model=str(llama_folder),
            logits_processors=[NoRepeat],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
