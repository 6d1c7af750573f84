"""/metrics scraped as Prometheus scrapes it: with each Accept header Prometheus sends, and
by a real Prometheus (Debian's package, installed by the test where it is missing), whose
stored names must be vLLM's.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from aiohttp import web

from aioserve.server.metrics import METRICS, PrometheusStatLogger, serve_metrics
from tests.child_process import die_with_parent
from tests.debian_packages import debian_program
from tests.server.conftest import BackgroundLoop, serve_app
from tests.server.metrics_steps import DECODE_STEP, MODEL, PREFILL_STEP, families, value
from tests.server.serve_process import free_port

# The Accept headers Prometheus sends by default (scrape/scrape.go and config/config.go).
PROMETHEUS_ACCEPTS = {
    # 2.x before scrape_protocols, Debian bookworm's 2.42 among them.
    "2.42": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    # 2.49 to 2.55: weighted by scrape_protocols.
    "2.49": "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    # 3.0: UTF-8 names asked of every protocol.
    "3.0": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,application/openmetrics-text;version=0.0.1;escaping=allow-utf-8;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;escaping=allow-utf-8;q=0.3,*/*;q=0.2",
    # 3.x as its content negotiation page documents it.
    "3.x": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    # 3.x with metric_name_validation_scheme: legacy.
    "3.x-legacy-names": "application/openmetrics-text;version=1.0.0;escaping=underscores;q=0.6,application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=underscores;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    # 3.x scraping native histograms: protobuf first.
    "3.x-native-histograms": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.6,application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    "curl": "*/*",
    "none": "",
}
SCRAPED_SAMPLES = {
    "vllm:num_requests_running": 0,
    "vllm:generation_tokens_total": 5,
    "vllm:time_to_first_token_seconds_count": 2,
    "vllm:prompt_tokens_total": 20,  # 12 computed, 8 from the prefix cache
}
"""Samples of PREFILL_STEP then DECODE_STEP, as a dashboard built for vLLM queries them."""


@pytest.fixture(scope="module")
def metrics_url(server_loop: BackgroundLoop) -> Iterator[str]:
    """The URL of /metrics on an app whose metrics recorded PREFILL_STEP and DECODE_STEP."""
    stat_logger = PrometheusStatLogger(MODEL, max_model_len=2048)
    stat_logger.record(PREFILL_STEP)
    stat_logger.record(DECODE_STEP)
    app = web.Application()
    app[METRICS] = stat_logger
    app.router.add_get("/metrics", serve_metrics)
    with serve_app(server_loop, app) as url:
        yield url + "/metrics"


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """GET `url`: the Content-Type and the body."""
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.headers["Content-Type"], reply.read().decode()


@pytest.mark.parametrize("accept", PROMETHEUS_ACCEPTS.values(), ids=PROMETHEUS_ACCEPTS.keys())
def test_every_scraper_gets_vllms_names(metrics_url, accept):
    content_type, text = http_get(metrics_url, {"Accept": accept} if accept else {})
    m = families(text)
    # A sample whose name matches no `# TYPE` line comes back as a family of its own,
    # untyped: the TYPE lines and the samples must name the same metrics.
    assert [name for name, family in m.items() if family.type == "unknown"] == []
    names = {sample.name for family in m.values() for sample in family.samples}
    assert not {name for name in names if name.startswith("vllm_")}
    for name, expected in SCRAPED_SAMPLES.items():
        assert value(m, name) == expected, name
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"


@pytest.mark.slow
def test_a_real_prometheus_stores_vllms_names(metrics_url, tmp_path):
    prometheus_program = debian_program("prometheus", "prometheus")
    target = urllib.parse.urlsplit(metrics_url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        f"scrape_configs: [{{job_name: aioserve, static_configs: [{{targets: ['{target}']}}]}}]\n"
    )
    listen = f"127.0.0.1:{free_port()}"
    api = f"http://{listen}/api/v1"
    log = tmp_path / "prometheus.log"

    def query(promql: str) -> dict[str, float]:
        """Each series `promql` selects now, by its metric name."""
        url = f"{api}/query?" + urllib.parse.urlencode({"query": promql})
        reply = json.loads(http_get(url)[1])
        return {r["metric"]["__name__"]: float(r["value"][1]) for r in reply["data"]["result"]}

    with log.open("w") as log_file:
        prometheus = subprocess.Popen(
            [
                prometheus_program,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={listen}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )
    try:
        deadline = time.monotonic() + 30
        stored: dict[str, float] = {}
        while time.monotonic() < deadline and prometheus.poll() is None:
            try:
                stored = query('{job="aioserve", __name__=~"vllm.*"}')
            except OSError:  # not listening yet
                stored = {}
            if stored:
                break
            time.sleep(0.2)
        assert stored, f"Prometheus stored nothing; its log:\n{log.read_text()}"
        assert not {name for name in stored if name.startswith("vllm_")}
        for name, expected in SCRAPED_SAMPLES.items():
            assert query(name) == {name: expected}, name
    finally:
        prometheus.kill()
        prometheus.wait()
