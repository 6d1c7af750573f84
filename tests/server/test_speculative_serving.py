"""End to end: `python -m aioserve serve --speculative-config` (n-gram prompt lookup), driven
over real HTTP by the official `openai` client.

One server per module (`spec_server`): the default model, float32, drafting up to 4 tokens
a step from n-grams of 2 to 4 tokens. The prompts repeat themselves (a sentence, a code
block to copy), so most decodes have drafts and most drafts are kept.

Speculation must not change what a request gets: a sequence samples the tokens it samples
without speculation, greedy or seeded, and drafts never take it past max_tokens or a stop.
The reference without speculation is conftest.py's in-process engine on the same model
(`openai_server`: float32, seed 0), asked the same over HTTP; token ids, usage and logprobs
are compared with it, texts exactly, logprobs to float32 rounding. /metrics must carry
vLLM's speculative-decoding counters, and they must add up.

The plain server of test_openai_subprocess.py checks that without --speculative-config none
of these series appear; tests/config/test_speculative_config.py checks the flag's values.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from prometheus_client.samples import Sample

from tests.child_process import start_logged
from tests.server.conftest import MODEL
from tests.server.openai_helpers import client
from tests.server.serve_process import MAX_MODEL_LEN, metric, serve_model, wait_until_metrics_idle

NUM_DRAFTS = 4
SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": NUM_DRAFTS,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
FLAG = "--speculative-config"

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
COPY_PROMPT = f"Copy this code exactly:\n{CODE}\nCopy:\n"
"""Greedy, the model copies the code and then varies it: drafts kept and drafts refused."""
CAT_PROMPT = "The cat sat on the mat. " * 6
"""Greedy, the model repeats the sentence: nearly every draft is kept."""
MAT = 1171  # the token " mat"
MAX_TOKENS = 64

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
LABELS = {"model_name": MODEL, "engine": "0"}


# --- the servers -------------------------------------------------------------------------------


@dataclass
class SpecServer:
    url: str
    log: Path


@pytest.fixture(scope="module")
def spec_server(smollm2_gguf, tmp_path_factory) -> Iterator[SpecServer]:
    """`aioserve serve` on the default model with n-gram speculation, as start_server's
    options otherwise (float32, seed 0, 1024-token context), without an API key."""
    log = tmp_path_factory.mktemp("serve-speculative") / "serve.log"
    options = ["--max-model-len", str(MAX_MODEL_LEN), "--seed", "0", "--dtype", "float32"]
    options += ["--enforce-eager", FLAG, json.dumps(SPECULATIVE_CONFIG)]
    with serve_model(smollm2_gguf, MODEL, log, *options) as url:
        yield SpecServer(url, log)


@pytest.fixture(scope="module")
def spec(spec_server: SpecServer) -> openai.OpenAI:
    return client(spec_server.url)


@pytest.fixture(scope="module")
def plain(openai_server: str) -> openai.OpenAI:
    """The same model without speculation (conftest.py's in-process engine)."""
    return client(openai_server)


def _complete(api: openai.OpenAI, prompt: str, max_tokens: int, **fields: Any):
    """A completion whose vLLM fields (ignore_eos, stop_token_ids...) go in the body."""
    standard = {"temperature", "seed", "logprobs", "stop", "n", "top_p", "stream"}
    standard |= {"stream_options", "frequency_penalty", "presence_penalty"}
    extra = {k: v for k, v in fields.items() if k not in standard}
    return api.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
        **{k: v for k, v in fields.items() if k in standard},
    )


@pytest.fixture(scope="module")
def greedy(spec):
    return _complete(spec, COPY_PROMPT, MAX_TOKENS, temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def greedy_without_speculation(plain):
    return _complete(plain, COPY_PROMPT, MAX_TOKENS, temperature=0, logprobs=2)


def _in_parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Run the calls at once (the server batches them); their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


# --- /metrics ---------------------------------------------------------------------------------


@dataclass
class Speculation:
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: list[float]

    @classmethod
    def read(cls, samples: list[Sample]) -> Speculation:
        per_pos = [
            metric(samples, ACCEPTED_PER_POS, **LABELS, position=str(p)) for p in range(NUM_DRAFTS)
        ]
        return cls(
            metric(samples, DRAFTS, **LABELS),
            metric(samples, DRAFT_TOKENS, **LABELS),
            metric(samples, ACCEPTED, **LABELS),
            per_pos,
        )

    def __sub__(self, before: Speculation) -> Speculation:
        return Speculation(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos, strict=True)],
        )

    def check_consistent(self) -> None:
        """What any count of n-gram drafts satisfies."""
        assert self.accepted <= self.draft_tokens <= NUM_DRAFTS * self.drafts, self
        assert self.drafts <= self.draft_tokens, self  # a draft has 1 token at least
        # A draft's token at position p is kept only if those before it were.
        assert self.accepted_per_pos == sorted(self.accepted_per_pos, reverse=True), self
        assert self.accepted_per_pos[0] <= self.drafts, self
        assert sum(self.accepted_per_pos) == self.accepted, self


def _speculation_during(url: str, run: Callable[[], Any]) -> tuple[Any, Speculation]:
    """`run()`'s result and how the speculation counters moved while it ran."""
    before = Speculation.read(wait_until_metrics_idle(url))
    result = run()
    after = Speculation.read(wait_until_metrics_idle(url))
    return result, after - before


# --- start-up ---------------------------------------------------------------------------------


def _refused_serve(argv: list[str], log: Path) -> str:
    """`aioserve serve argv` run to its end: its exit status must be 2; its output."""
    environment = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    argv = [sys.executable, "-m", "aioserve", "serve", *argv]
    process = start_logged(argv, log, environment)
    try:
        assert process.wait(timeout=300) == 2, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    return log.read_text()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is a vLLM method"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "key 'k' is not supported"),
    ],
)
def test_a_refused_speculative_config_stops_serve_before_the_model_loads(
    tmp_path, settings, message
):
    output = _refused_serve(["no/such-model", FLAG, json.dumps(settings)], tmp_path / "log")
    assert f"aioserve: error: {FLAG} {message}" in output


@pytest.mark.slow
def test_async_scheduling_with_speculation_stops_serve(smollm2_gguf, tmp_path):
    argv = [str(smollm2_gguf), "--port", "0", "--dtype", "float32", "--enforce-eager"]
    argv += ["--async-scheduling", FLAG, json.dumps(SPECULATIVE_CONFIG)]
    output = _refused_serve(argv, tmp_path / "log")
    assert f"aioserve: error: --async-scheduling cannot be combined with {FLAG}" in output, output[
        -3000:
    ]
    assert "engine ready" not in output and "Traceback" not in output


@pytest.mark.slow
def test_the_server_logs_speculation_and_schedules_synchronously(spec_server):
    log = spec_server.log.read_text()
    assert "speculative decoding: n-gram lookup, 4 drafts a step, n-grams of 2-4 tokens" in log
    assert "asynchronous scheduling off" in log


# --- the same tokens as without speculation --------------------------------------------------


@pytest.mark.slow
def test_greedy_completion_is_the_one_without_speculation(greedy, greedy_without_speculation):
    (choice,), (expected,) = greedy.choices, greedy_without_speculation.choices
    assert choice.text == expected.text
    assert choice.token_ids == expected.token_ids
    assert choice.finish_reason == "length"
    assert greedy.usage.completion_tokens == len(choice.token_ids) == MAX_TOKENS
    assert greedy.usage.prompt_tokens == greedy_without_speculation.usage.prompt_tokens


@pytest.mark.slow
def test_greedy_logprobs_have_one_entry_a_token_and_the_values_without_speculation(
    greedy, greedy_without_speculation
):
    (choice,), (expected,) = greedy.choices, greedy_without_speculation.choices
    logprobs, reference = choice.logprobs, expected.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == MAX_TOKENS
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == MAX_TOKENS
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.tokens == reference.tokens
    for token, logprob, top, top_expected in zip(
        logprobs.tokens,
        logprobs.token_logprobs,
        logprobs.top_logprobs,
        reference.top_logprobs,
        strict=True,
    ):
        assert len(top) == 2 and max(top, key=top.get) == token  # greedy: the likeliest
        assert top[token] == logprob <= 0
        # A draft's logits come from a step of several tokens: equal up to rounding.
        assert top.keys() == top_expected.keys()
        for candidate, value in top.items():
            assert value == pytest.approx(top_expected[candidate], abs=1e-3)


@pytest.mark.slow
def test_streamed_greedy_completion_is_the_full_one(spec, greedy):
    stream = _complete(
        spec,
        COPY_PROMPT,
        MAX_TOKENS,
        temperature=0,
        logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    *chunks, usage_chunk = list(stream)
    assert chunks and all(len(c.choices) == 1 for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == greedy.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    tokens_a_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert sum(tokens_a_chunk) == MAX_TOKENS
    # Kept drafts arrive with the token of their step.
    assert max(tokens_a_chunk) > 1, tokens_a_chunk
    assert [t for c in chunks for t in c.choices[0].token_ids] == greedy.choices[0].token_ids
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    assert usage_chunk.usage.prompt_tokens == greedy.usage.prompt_tokens


@pytest.mark.slow
def test_a_seed_fixes_the_sampled_text_as_without_speculation(spec, spec_server, plain):
    def sampled(api: openai.OpenAI, seed: int) -> Callable[[], Any]:
        return lambda: _complete(api, CAT_PROMPT, 24, temperature=0.8, seed=seed)

    # Two requests with one seed in one batch, one with another seed beside them.
    (first, again, other), moved = _speculation_during(
        spec_server.url,
        lambda: _in_parallel(sampled(spec, 11), sampled(spec, 11), sampled(spec, 12)),
    )
    without = sampled(plain, 11)()
    assert first.choices[0].token_ids == again.choices[0].token_ids
    assert first.choices[0].text == again.choices[0].text == without.choices[0].text
    assert first.choices[0].token_ids == without.choices[0].token_ids
    assert other.choices[0].text != first.choices[0].text  # the seed decides
    assert moved.accepted > 0  # random samples kept drafts too
    moved.check_consistent()


@pytest.mark.slow
def test_penalties_count_the_drafts_as_without_speculation(spec, spec_server, plain):
    # Penalties weaker than the pull to repeat: the output still repeats, and drafts are
    # kept, while each position's penalties count the drafts before it as output. They
    # grow with every repetition until they break the pattern (a line break after the
    # fourth sentence): where, depends on counting them right.
    fields = dict(temperature=0, frequency_penalty=0.5, presence_penalty=0.3)
    fields |= dict(repetition_penalty=1.02)
    answer, moved = _speculation_during(
        spec_server.url, lambda: _complete(spec, CAT_PROMPT, 40, **fields)
    )
    expected = _complete(plain, CAT_PROMPT, 40, **fields)
    assert answer.choices[0].token_ids == expected.choices[0].token_ids
    assert answer.choices[0].text == expected.choices[0].text
    assert "\n" in answer.choices[0].text[1:]  # the penalties broke the pattern
    assert moved.accepted > 0


# --- drafts stop where the request stops -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [3, 6, 7, 9])
def test_drafts_never_pass_max_tokens(spec, spec_server, max_tokens):
    answer, moved = _speculation_during(
        spec_server.url, lambda: _complete(spec, CAT_PROMPT, max_tokens, temperature=0)
    )
    (choice,) = answer.choices
    assert answer.usage.completion_tokens == len(choice.token_ids) == max_tokens
    assert choice.finish_reason == "length"
    if max_tokens > 3:
        assert moved.drafts > 0  # it speculated, within its budget
    moved.check_consistent()


@pytest.mark.slow
def test_a_stop_token_inside_the_drafts_ends_the_request_there(spec, spec_server, plain):
    fields = dict(temperature=0, logprobs=1, stop_token_ids=[MAT])
    answer, moved = _speculation_during(
        spec_server.url, lambda: _complete(spec, CAT_PROMPT, 30, **fields)
    )
    expected = _complete(plain, CAT_PROMPT, 30, **fields)
    (choice,), (reference,) = answer.choices, expected.choices
    assert choice.token_ids == reference.token_ids
    assert choice.token_ids[-1] == MAT and MAT not in choice.token_ids[:-1]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (
        reference.text,
        "stop",
        MAT,
    )
    assert answer.usage.completion_tokens == len(choice.token_ids)
    assert len(choice.logprobs.tokens) == len(choice.token_ids)
    assert moved.accepted > 0  # the stop token was a kept draft's, or came with them


@pytest.mark.slow
@pytest.mark.parametrize(
    ("max_tokens", "fields"),
    [
        (30, dict(stop=["mat"])),
        (30, dict(stop=[" on the"], include_stop_str_in_output=True)),
        # The step that completes the stop string also reaches max_tokens: the stop wins.
        (6, dict(stop=[" sat"])),
    ],
    ids=["stop", "stop-included", "stop-and-max-tokens"],
)
def test_a_stop_string_inside_the_drafts_ends_the_tokens_there(
    spec, spec_server, plain, max_tokens, fields
):
    # vLLM (and aioserve without speculation) ends the output with the token that
    # completes the stop string: the tokens the same step kept after it are not output.
    fields = dict(temperature=0, logprobs=1, **fields)
    answer, moved = _speculation_during(
        spec_server.url, lambda: _complete(spec, CAT_PROMPT, max_tokens, **fields)
    )
    expected = _complete(plain, CAT_PROMPT, max_tokens, **fields)
    (choice,), (reference,) = answer.choices, expected.choices
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (
        reference.text,
        "stop",
        fields["stop"][0],
    )
    assert choice.token_ids == reference.token_ids
    assert answer.usage.completion_tokens == expected.usage.completion_tokens
    assert len(choice.logprobs.tokens) == len(reference.logprobs.tokens)
    assert moved.accepted > 0


# --- structured output beside drafting requests ------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "pets": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 3,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
PERSON_MESSAGES = [
    {
        "role": "user",
        "content": "Describe a person called Ana, aged 30, with pets cat, cat, cat, as JSON.",
    }
]


@pytest.mark.slow
def test_structured_output_is_valid_json_beside_a_speculating_request(spec, plain, greedy):
    def person(api: openai.OpenAI) -> Callable[[], Any]:
        return lambda: api.chat.completions.create(
            model=MODEL,
            messages=PERSON_MESSAGES,
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        )

    answer, copied = _in_parallel(
        person(spec), lambda: _complete(spec, COPY_PROMPT, MAX_TOKENS, temperature=0, logprobs=2)
    )
    (choice,) = answer.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert choice.message.content == person(plain)().choices[0].message.content
    # The request batched with it got its solo answer.
    assert copied.choices[0].token_ids == greedy.choices[0].token_ids


# --- /metrics -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_metrics_count_drafts_and_kept_tokens_as_vllm(spec, spec_server):
    before = wait_until_metrics_idle(spec_server.url)
    answer = _complete(spec, CAT_PROMPT, 32, temperature=0)
    assert answer.usage.completion_tokens == 32
    after = wait_until_metrics_idle(spec_server.url)

    spec_samples = [s for s in after if s.name.startswith("vllm:spec_decode_")]
    counters = {s.name for s in spec_samples if s.name.endswith("_total")}
    assert counters == {DRAFTS, DRAFT_TOKENS, ACCEPTED, ACCEPTED_PER_POS}
    for sample in spec_samples:
        extra = (
            {"position"}
            if sample.name.startswith(ACCEPTED_PER_POS.removesuffix("_total"))
            else set()
        )
        assert sample.labels.keys() == LABELS.keys() | extra, sample
        assert LABELS.items() <= sample.labels.items(), sample
    positions = {s.labels["position"] for s in spec_samples if s.name == ACCEPTED_PER_POS}
    assert positions == {str(p) for p in range(NUM_DRAFTS)}

    total = Speculation.read(after)
    total.check_consistent()
    moved = Speculation.read(after) - Speculation.read(before)
    moved.check_consistent()
    assert moved.drafts > 0 and moved.accepted > 0
    # The sentence repeats: most drafts are kept (an off-by-one check would keep none).
    assert moved.accepted >= moved.draft_tokens / 2, moved
    # The first token comes from the prompt's step; each later step samples 1 token more
    # than the drafts it keeps, so the kept drafts are at most the tokens after the first.
    assert moved.accepted <= 32 - 1 - moved.drafts
    generated = metric(after, "vllm:generation_tokens_total") - metric(
        before, "vllm:generation_tokens_total"
    )
    assert generated == 32
