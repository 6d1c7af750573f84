"""The benchmark datasets on small fixtures: prompt lengths checked with the tokenizer itself."""

from __future__ import annotations

import csv
import json
from collections import Counter

import pytest

from aioserve.benchmarks import datasets
from aioserve.benchmarks.datasets import DatasetError


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)


# --- random -----------------------------------------------------------------------------


def test_random_prompts_have_exactly_the_requested_length(tokenizer):
    requests = datasets.random_requests(tokenizer, 6, input_len=40, output_len=7, seed=3)
    assert len(requests) == 6
    for request in requests:
        assert request.prompt_len == 40
        assert token_count(tokenizer, request.prompt) == 40
        assert request.expected_output_len == 7
    assert len({r.prompt for r in requests}) == 6


def test_random_range_ratio_and_prefix(tokenizer):
    requests = datasets.random_requests(
        tokenizer, 20, input_len=40, output_len=10, prefix_len=8, range_ratio=0.5, seed=1
    )
    for request in requests:
        assert request.prompt_len == token_count(tokenizer, request.prompt)
        # [40 * 0.5, 40 * 1.5] after 8 prefix tokens; outputs in [5, 15]
        assert 8 + 20 <= request.prompt_len <= 8 + 60
        assert 5 <= request.expected_output_len <= 15
    assert len({r.prompt_len for r in requests}) > 1
    assert len({r.expected_output_len for r in requests}) > 1
    heads = {tuple(tokenizer(r.prompt).input_ids[:4]) for r in requests}
    assert len(heads) == 1, "every prompt starts with the shared prefix"


def test_random_is_reproducible_from_its_seed(tokenizer):
    def prompts(seed):
        return [r.prompt for r in datasets.random_requests(tokenizer, 3, 24, 4, seed=seed)]

    assert prompts(5) == prompts(5)
    assert prompts(5) != prompts(6)


def test_random_refuses_a_bad_range_ratio(tokenizer):
    with pytest.raises(DatasetError, match=r"\[0, 1\)"):
        datasets.random_requests(tokenizer, 2, 16, 4, range_ratio=1.0)


# --- sharegpt ---------------------------------------------------------------------------

CONVERSATIONS = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "Explain why the sky looks blue on a clear afternoon."},
            {"from": "gpt", "value": "Sunlight scatters off air molecules, blue the most."},
        ],
    },
    {"id": "short", "conversations": [{"value": "Hi"}, {"value": "Hello there, friend!"}]},
    {"id": "one-turn", "conversations": [{"value": "Is anybody listening to this at all?"}]},
    {
        "id": "b",
        "conversations": [
            {"from": "human", "value": "Write a haiku about rivers flowing to the sea."},
            {"from": "gpt", "value": "Water finds its way, past stones and roots, to the sea."},
            {"from": "human", "value": "Another one?"},
        ],
    },
]


@pytest.fixture
def sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    return str(path)


def test_sharegpt_takes_the_first_two_turns_and_their_lengths(tokenizer, sharegpt_file):
    requests = datasets.sharegpt_requests(tokenizer, 2, sharegpt_file)
    pairs = {
        (c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in CONVERSATIONS[::3]
    }
    assert {r.prompt for r in requests} == {p for p, _ in pairs}
    replies = dict(pairs)
    for request in requests:
        assert request.prompt_len == token_count(tokenizer, request.prompt)
        assert request.expected_output_len == token_count(tokenizer, replies[request.prompt])


def test_sharegpt_output_len_override_and_oversampling(tokenizer, sharegpt_file):
    requests = datasets.sharegpt_requests(tokenizer, 5, sharegpt_file, output_len=3)
    assert len(requests) == 5  # two usable conversations, repeated
    assert {r.expected_output_len for r in requests} == {3}
    assert {r.prompt for r in requests} <= {c["conversations"][0]["value"] for c in CONVERSATIONS}


def test_sharegpt_file_errors(tokenizer, tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        datasets.sharegpt_requests(tokenizer, 1, str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DatasetError, match="not valid JSON"):
        datasets.sharegpt_requests(tokenizer, 1, str(bad))
    useless = tmp_path / "useless.json"
    useless.write_text(json.dumps(CONVERSATIONS[1:3]))
    with pytest.raises(DatasetError, match="no conversation"):
        datasets.sharegpt_requests(tokenizer, 1, str(useless))


# --- sonnet -----------------------------------------------------------------------------


def test_the_shipped_sonnets():
    lines = datasets.SONNETS.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 11 * 14
    assert lines[0] == "From fairest creatures we desire increase,"
    assert "Shall I compare thee to a summer's day?" in lines


def test_sonnet_prompts_fit_the_requested_length(tokenizer):
    lines = datasets.SONNETS.read_text(encoding="utf-8").splitlines(keepends=True)
    longest_line = max(token_count(tokenizer, line) for line in lines)
    requests = datasets.sonnet_requests(
        tokenizer, 4, input_len=160, output_len=9, prefix_len=80, seed=2
    )
    for request in requests:
        assert request.prompt_len == token_count(tokenizer, request.prompt)
        assert 160 - 2 * longest_line <= request.prompt_len <= 160
        assert request.expected_output_len == 9
        assert datasets.SONNET_INSTRUCTION + lines[0] + lines[1] in request.prompt
        assert request.prompt.startswith("<|im_start|>")  # the chat template is applied
    raw = datasets.sonnet_requests(tokenizer, 1, input_len=160, prefix_len=80, chat_formatted=False)
    assert raw[0].prompt.startswith(datasets.SONNET_INSTRUCTION + lines[0])


def test_sonnet_from_a_file_and_a_too_short_length(tokenizer, tmp_path):
    poem = tmp_path / "poem.txt"
    poem.write_text("Tyger Tyger, burning bright,\nIn the forests of the night;\n")
    requests = datasets.sonnet_requests(tokenizer, 2, input_len=80, prefix_len=0, path=str(poem))
    assert all("Tyger" in r.prompt or "forests" in r.prompt for r in requests)
    with pytest.raises(DatasetError, match="more than the instruction"):
        datasets.sonnet_requests(tokenizer, 1, input_len=5)


# --- burstgpt ---------------------------------------------------------------------------


def test_burstgpt_uses_gpt4_rows_with_a_response(tokenizer, tmp_path):
    path = tmp_path / "burst.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(
            ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
        )
        writer.writerow([5, "GPT-4", 12, 5, 17, "Conversation log"])
        writer.writerow([7, "ChatGPT", 30, 9, 39, "Conversation log"])
        writer.writerow([9, "GPT-4", 20, 0, 20, "Conversation log"])
        writer.writerow([11, "GPT-4", 25, 3, 28, "API log"])
    requests = datasets.burstgpt_requests(tokenizer, 2, str(path))
    assert sorted((r.prompt_len, r.expected_output_len) for r in requests) == [(12, 5), (25, 3)]
    for request in requests:
        assert token_count(tokenizer, request.prompt) == request.prompt_len
    more = datasets.burstgpt_requests(tokenizer, 5, str(path))
    assert len(more) == 5
    assert {(r.prompt_len, r.expected_output_len) for r in more} <= {(12, 5), (25, 3)}


def test_burstgpt_rejects_another_csv(tokenizer, tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(DatasetError, match="not a BurstGPT CSV"):
        datasets.burstgpt_requests(tokenizer, 1, str(path))


# --- prefix_repetition ------------------------------------------------------------------


def test_prefix_repetition_groups_share_their_prefix(tokenizer):
    requests = datasets.prefix_repetition_requests(
        tokenizer, 7, prefix_len=24, suffix_len=10, num_prefixes=2, output_len=6, seed=4
    )
    assert len(requests) == 6  # 7 // 2 prompts per prefix
    for request in requests:
        assert request.prompt_len == 34
        assert token_count(tokenizer, request.prompt) == 34
        assert request.expected_output_len == 6
    groups = Counter(tuple(tokenizer(r.prompt).input_ids[:16]) for r in requests)
    assert sorted(groups.values()) == [3, 3]
    assert len({r.prompt for r in requests}) == 6


def test_prefix_repetition_needs_enough_prompts(tokenizer):
    with pytest.raises(DatasetError, match="at least"):
        datasets.prefix_repetition_requests(tokenizer, 2, num_prefixes=3)


def test_the_hf_dataset_is_refused_with_a_way_out():
    with pytest.raises(DatasetError, match="Hugging Face hub.*--dataset-name sharegpt"):
        datasets.refuse_hf_dataset()
