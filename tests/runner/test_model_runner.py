"""The ModelRunner on plain step plans, against transformers and against the sampler's
reference fed the way the engine used to feed it (state rebuilt from token lists)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from aioserve.kernels.sampling import apply_bias_and_penalties
from aioserve.runner import model_runner
from aioserve.runner.step_plan import SamplingSettings
from tests.runner.plans import GREEDY, PlanMaker, run_step, tiny_runner

PROMPTS = {
    "a": [3, 17, 200, 45, 9, 88, 120, 7, 64, 33, 5],
    "b": [250, 1, 2, 3],
    "c": [60, 61, 62, 63, 64, 65, 66],
}


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def greedy_run(runner, block_size: int, num_new: int, *, known: bool) -> dict[str, list[int]]:
    """Three sequences, one prompt in two chunks, then decodes; `known`: decode inputs sent
    by the host, else taken from the runner's own record of the last sampled tokens."""
    maker = PlanMaker(block_size, 64)
    out = {seq_id: [] for seq_id in PROMPTS}

    def step(steps):
        result = run_step(runner, maker.plan(steps, known=known))
        for seq_id, tokens in result.sampled.items():
            out[seq_id] += tokens
        maker.learn(result.sampled)

    maker.admit("a", PROMPTS["a"])
    maker.admit("b", PROMPTS["b"])
    step([("a", 6), ("b", 4)])
    maker.admit("c", PROMPTS["c"])
    step([("a", 5), ("b", 1), ("c", 7)])
    while any(len(tokens) < num_new for tokens in out.values()):
        step([(seq_id, 1) for seq_id, tokens in out.items() if len(tokens) < num_new])
    return out


def test_greedy_tokens_equal_transformers_over_chunked_and_mixed_steps():
    hf, runner = tiny_runner()
    out = greedy_run(runner, 4, 8, known=True)
    for seq_id, prompt in PROMPTS.items():
        assert out[seq_id] == hf_greedy(hf, prompt, 8), seq_id


@pytest.mark.parametrize("config_name", ["mistral", "qwen2-tied", "qwen3"])
def test_a_decode_of_the_last_sampled_token_equals_one_the_host_sends(config_name):
    _, runner_known = tiny_runner(config_name)
    _, runner_pending = tiny_runner(config_name)
    assert greedy_run(runner_known, 4, 6, known=True) == greedy_run(
        runner_pending, 4, 6, known=False
    )


def test_logprobs_and_seeded_samples_do_not_depend_on_who_knows_the_input_token():
    settings = SamplingSettings(temperature=0.9, top_k=50, top_p=0.9, min_p=0.0, seed=7, logprobs=3)
    results = []
    for known in (True, False):
        _, runner = tiny_runner()
        maker = PlanMaker(4, 64)
        maker.admit("s", PROMPTS["a"], settings)
        steps = [run_step(runner, maker.plan([("s", len(PROMPTS["a"]))]))]
        maker.learn(steps[-1].sampled)
        for _ in range(5):
            plan = maker.plan([("s", 1)], known=False) if not known else maker.plan([("s", 1)])
            steps.append(run_step(runner, plan))
            maker.learn(steps[-1].sampled)
        results.append(steps)
    for known_step, pending_step in zip(*results, strict=True):
        assert known_step == pending_step


def test_step_indices_count_each_sequences_samples_and_continue_after_readmission():
    _, runner = tiny_runner()
    maker = PlanMaker(4, 64)
    maker.admit("x", PROMPTS["a"])
    maker.admit("y", PROMPTS["b"])
    prepared = runner.prepare(maker.plan([("x", 11), ("y", 2)]))
    assert prepared.sampling.seeds_and_steps[1].tolist() == [0]  # y's chunk does not sample
    maker.learn(runner.collect(runner.execute(prepared)).sampled)
    steps = []
    for _ in range(3):
        prepared = runner.prepare(maker.plan([("x", 1), ("y", 1)], known=False))
        steps.append(prepared.sampling.seeds_and_steps[1].tolist())
        maker.learn(runner.collect(runner.execute(prepared)).sampled)
    assert steps == [[1], [2, 0], [3, 1]]
    # Preempted and re-admitted with its 4 tokens: its next token is its 5th (index 4).
    tokens = maker.seqs["x"].tokens
    maker.finish("x")
    maker.admit("x", PROMPTS["a"], output=tokens[len(PROMPTS["a"]) :])
    prepared = runner.prepare(maker.plan([("x", len(tokens))]))
    assert prepared.sampling.seeds_and_steps[1].tolist() == [4]


def capture_sampler(monkeypatch) -> list:
    """Record (logits, batch, tokens) of every sampler call the runner makes; the batch's
    penalty state as it was then, gathered into rows of its own."""
    calls = []
    real = model_runner.sample

    def sample(logits, batch, race=None):
        snapshot = batch
        if batch.state_rows is not None:
            snapshot = dataclasses.replace(
                batch,
                output_token_counts=batch.output_token_counts[batch.state_rows].clone(),
                prompt_token_mask=batch.prompt_token_mask[batch.state_rows].clone(),
                state_rows=None,
            )
        out = real(logits, batch, race)
        calls.append((logits.clone(), snapshot, out.token_ids.clone()))
        return out

    monkeypatch.setattr(model_runner, "sample", sample)
    return calls


def test_penalty_counts_live_in_the_runner_and_restart_with_a_reused_slot(monkeypatch):
    calls = capture_sampler(monkeypatch)
    _, runner = tiny_runner(max_num_seqs=2)
    penalized = dataclasses.replace(
        GREEDY, repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.3
    )
    maker = PlanMaker(4, 64)
    histories = {}

    def generate(seq_id: str, prompt: list[int], steps: int) -> None:
        maker.admit(seq_id, prompt, penalized)
        maker.learn(run_step(runner, maker.plan([(seq_id, len(prompt))])).sampled)
        for _ in range(steps):
            maker.learn(run_step(runner, maker.plan([(seq_id, 1)], known=False)).sampled)
        histories[seq_id] = maker.seqs[seq_id].tokens[len(prompt) :]
        maker.finish(seq_id)

    generate("first", PROMPTS["a"], 6)
    generate("second", PROMPTS["c"], 6)  # takes the slot "first" left
    vocab = runner.vocab_size
    for seq_id, prompt in (("first", PROMPTS["a"]), ("second", PROMPTS["c"])):
        seq_calls = calls[:7] if seq_id == "first" else calls[7:]
        history = histories[seq_id]
        for step, (logits, batch, token) in enumerate(seq_calls):
            counts = torch.bincount(
                torch.tensor(history[:step], dtype=torch.int64), minlength=vocab
            )
            prompt_mask = torch.zeros(vocab, dtype=torch.bool)
            prompt_mask[prompt] = True
            assert torch.equal(batch.output_token_counts[0], counts.to(torch.int32))
            assert torch.equal(batch.prompt_token_mask[0], prompt_mask)
            # The reference over state rebuilt from the history picks the same token.
            rebuilt = dataclasses.replace(
                batch,
                output_token_counts=counts[None].to(torch.int32),
                prompt_token_mask=prompt_mask[None],
            )
            assert int(apply_bias_and_penalties(logits, rebuilt).argmax()) == int(token)


def test_min_tokens_bans_lift_after_the_minimum_and_allowed_ids_hold(monkeypatch):
    calls = capture_sampler(monkeypatch)
    _, runner = tiny_runner()
    allowed = tuple(range(100, 140))
    settings = SamplingSettings(
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        min_p=0.0,
        seed=3,
        logit_bias={120: 5.0},
        allowed_token_ids=allowed,
        min_tokens=3,
        min_tokens_banned_ids=(101, 102),
    )
    maker = PlanMaker(4, 64)
    maker.admit("m", PROMPTS["b"], settings)
    sampled = []
    result = run_step(runner, maker.plan([("m", len(PROMPTS["b"]))]))
    for _ in range(6):
        sampled += result.sampled["m"]
        maker.learn(result.sampled)
        result = run_step(runner, maker.plan([("m", 1)], known=False))
    assert all(token in allowed for token in sampled)
    for step, (_, batch, _) in enumerate(calls):
        ids = batch.bias_token_ids[0].tolist()
        values = dict(zip(ids, batch.bias_values[0].tolist(), strict=True))
        assert values[120] == 5.0  # the fixed bias, every step
        # allowed_token_ids as a bitmask of the vocabulary: exactly the allowed bits set.
        assert batch.bitmask_rows.tolist() == [0]
        words = batch.token_bitmask[0].tolist()
        bits = [t for t in range(32 * len(words)) if (words[t // 32] >> (t % 32)) & 1]
        assert bits == list(allowed)
        assert (101 in ids and 102 in ids) == (step < 3), step
        if step < 3:
            assert sampled[step] not in (101, 102)


def test_preparing_a_decode_step_costs_the_same_for_any_vocabulary():
    """Per-step host arrays do not grow with the vocabulary, even with every sampling
    feature on (penalties, logit bias, allowed ids, min_tokens, logprobs)."""
    settings = SamplingSettings(
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=1,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={5: 1.0},
        allowed_token_ids=tuple(range(10, 200)),
        min_tokens=4,
        min_tokens_banned_ids=(11,),
        logprobs=2,
    )

    def host_bytes(vocab_size: int) -> int:
        _, runner = tiny_runner(vocab_size=vocab_size)
        maker = PlanMaker(4, 64)
        for seq_id, prompt in PROMPTS.items():
            maker.admit(seq_id, prompt, settings)
        first = runner.prepare(maker.plan([(s, len(p)) for s, p in PROMPTS.items()]))
        assert first.admissions  # admissions carry per-sequence data, once
        maker.learn(runner.collect(runner.execute(first)).sampled)
        step = runner.prepare(maker.plan([(s, 1) for s in PROMPTS], known=False))
        assert not step.admissions

        def size(value) -> int:
            if isinstance(value, np.ndarray):
                return value.nbytes
            if dataclasses.is_dataclass(value):
                return sum(size(getattr(value, f.name)) for f in dataclasses.fields(value))
            if isinstance(value, list):
                return sum(size(v) for v in value)
            return 0

        return size(step)

    assert host_bytes(256) == host_bytes(8192)


def test_a_plan_naming_an_unknown_sequence_or_missing_blocks_is_refused():
    _, runner = tiny_runner()
    maker = PlanMaker(4, 64)
    maker.admit("known", PROMPTS["b"])
    plan = maker.plan([("known", 4)])
    runner.prepare(plan)
    plan.chunks[0].seq_id = "stranger"
    with pytest.raises(KeyError, match="'stranger' is not in the runner"):
        runner.prepare(dataclasses.replace(plan, new_sequences=[]))
    short = maker.plan([("known", 1)], known=False)
    short.chunks[0].start += 8  # past the blocks the sequence was given
    short.chunks[0].token_ids = [1]
    with pytest.raises(ValueError, match="past its sequence's KV blocks"):
        runner.prepare(short)


@pytest.mark.parametrize("top_p", [1e-46, 1e-300])
def test_a_top_p_below_float32s_range_keeps_the_likeliest_token(top_p):
    """vLLM keeps at least one token whatever top_p in (0, 1]; one that rounds to 0 in
    float32 made the step fail (index -1), and three such requests killed the engine."""
    _, runner = tiny_runner()
    maker = PlanMaker(4, 64)
    tiny = SamplingSettings(temperature=1.0, top_k=-1, top_p=top_p, min_p=0.0, seed=3)
    maker.admit("tiny", PROMPTS["a"], tiny)
    maker.admit("greedy", PROMPTS["a"], GREEDY)
    for num_new in (len(PROMPTS["a"]), 1, 1):
        step = run_step(runner, maker.plan([("tiny", num_new), ("greedy", num_new)]))
        maker.learn(step.sampled)
        assert step.sampled["tiny"] == step.sampled["greedy"]
