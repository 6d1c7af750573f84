"""`observe_each` against prometheus-client's own `observe`, value by value: the same
bucket counts, the same count and the same sum, in the text Prometheus scrapes."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aioserve.server.bulk_observe import observe_each
from aioserve.server.metrics import TOKEN_LATENCY_BUCKETS


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_observing_all_at_once_gives_what_observing_one_by_one_gives():
    rng = random.Random(3)
    # Values on the bounds themselves (a bound's bucket holds them), between them, past
    # the last finite bound, and one alone (the single-value path).
    batches = [
        list(TOKEN_LATENCY_BUCKETS[:5]),
        [rng.uniform(0.0, 2 * TOKEN_LATENCY_BUCKETS[-1]) for _ in range(300)],
        [rng.uniform(0.0, 0.1) for _ in range(64)],
        [0.05],
        [],
    ]
    one_by_one, all_at_once = CollectorRegistry(), CollectorRegistry()
    first = Histogram(
        "itl", "x", ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=one_by_one
    )
    second = Histogram(
        "itl", "x", ["model_name"], buckets=TOKEN_LATENCY_BUCKETS, registry=all_at_once
    )
    for batch in batches:
        for amount in batch:
            first.labels("m").observe(amount)
        observe_each(second.labels("m"), batch)
    expected, got = samples(one_by_one), samples(all_at_once)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0] == "itl_sum":
            assert abs(got[key] - value) <= 1e-9 * value
        else:
            assert got[key] == value, key
    assert expected[("itl_count", (("model_name", "m"),))] == sum(len(b) for b in batches)
