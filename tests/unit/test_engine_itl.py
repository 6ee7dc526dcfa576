"""pdserve/bench/engine_itl.py: the engines' own inter-token latency, read from real Prometheus
endpoints (prometheus_client's exposition of a histogram named as vLLM's, on 127.0.0.1) and the
metrics URLs pdserve workers log."""

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from pdserve.bench import engine_itl


@pytest.fixture
def engines():
    """Two engines' /metrics, each with its own histogram, and a function observing on one."""
    servers, histograms = [], []
    for _ in range(2):
        registry = CollectorRegistry()
        histogram = Histogram(
            "vllm:inter_token_latency_seconds", "ITL", ["engine"], registry=registry
        )
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        servers.append((server, thread))
        histograms.append(histogram.labels(engine="0"))
    urls = [f"http://127.0.0.1:{server.server_port}/metrics" for server, _ in servers]
    yield urls, histograms
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_the_mean_counts_only_the_tokens_between_the_readings_over_every_engine(engines):
    urls, (first, second) = engines
    first.observe(5.0)  # before the run: not counted
    before = engine_itl.totals(urls)
    for latency in (0.1, 0.3):
        first.observe(latency)
    second.observe(0.2)
    after = engine_itl.totals(urls)
    assert engine_itl.mean_between(before, after) == pytest.approx(0.2)


def test_no_tokens_between_the_readings_is_no_figure(engines):
    urls, _ = engines
    reading = engine_itl.totals(urls)
    assert engine_itl.mean_between(reading, reading) is None


def test_other_histograms_are_not_counted():
    registry = CollectorRegistry()
    Histogram("vllm:time_to_first_token_seconds", "TTFT", registry=registry).observe(3.0)
    itl = Histogram("vllm:inter_token_latency_seconds", "ITL", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        before = engine_itl.totals([url])
        itl.observe(0.05)
        assert engine_itl.mean_between(before, engine_itl.totals([url])) == pytest.approx(0.05)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_each_workers_last_logged_metrics_url(tmp_path: Path):
    (tmp_path / "decode-11.log").write_text(
        "x metrics on http://127.0.0.1:1001/metrics\nrestarted\n"
        "x metrics on http://127.0.0.1:1002/metrics\n"
    )
    (tmp_path / "prefill-12.log").write_text("x metrics on http://127.0.0.1:2001/metrics\n")
    (tmp_path / "serve.log").write_text("pdserve ready\n")
    assert engine_itl.worker_metrics_urls(tmp_path) == [
        "http://127.0.0.1:1002/metrics",
        "http://127.0.0.1:2001/metrics",
    ]


def test_an_engine_that_does_not_answer_is_an_error_not_a_zero():
    with pytest.raises(httpx.ConnectError):  # nothing listens on the discard port
        engine_itl.totals(["http://127.0.0.1:9/metrics"], timeout_s=2)
