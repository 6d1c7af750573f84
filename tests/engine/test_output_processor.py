"""OutputProcessor.take_output: what a consumer gets when it takes its request's news."""

from __future__ import annotations

import pytest

from aioserve.engine.output_processor import OutputProcessor, RequestState
from aioserve.engine.outputs import RequestMetrics
from aioserve.engine.request import Request
from aioserve.engine.sampling_params import RequestOutputKind, SamplingParams


def one_sample_request(kind: RequestOutputKind) -> tuple[OutputProcessor, RequestState, Request]:
    params = SamplingParams(max_tokens=4, detokenize=False, output_kind=kind)
    request = Request("r", [1, 2], params, seed=0, eos_token_ids=frozenset(), max_tokens=4)
    processor = OutputProcessor(tokenizer=None)
    sample = processor.new_sample(0, request)
    state = RequestState("r", None, [1, 2], params, [sample], RequestMetrics(arrival_time=0.0))
    return processor, state, request


def produce(state: RequestState, request: Request, *tokens: int) -> None:
    request.output_token_ids.extend(tokens)
    state.changed.add(0)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_an_output_covers_every_step_since_the_last_and_none_is_due_without_news(kind):
    processor, state, request = one_sample_request(kind)
    assert processor.take_output(state) is None
    produce(state, request, 7)
    produce(state, request, 8)
    first = processor.take_output(state)
    assert first.outputs[0].token_ids == [7, 8] and not first.finished
    assert processor.take_output(state) is None  # news taken twice: nothing new the second time
    produce(state, request, 9)
    second = processor.take_output(state)
    delta = kind is RequestOutputKind.DELTA
    assert second.outputs[0].token_ids == ([9] if delta else [7, 8, 9])


def test_a_final_only_request_has_an_output_only_at_its_end():
    processor, state, request = one_sample_request(RequestOutputKind.FINAL_ONLY)
    produce(state, request, 7)
    assert processor.take_output(state) is None
    state.samples[0].finish_reason = "length"
    final = processor.take_output(state)
    assert final.finished and final.outputs[0].token_ids == [7]
