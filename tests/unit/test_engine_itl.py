"""pdserve/bench/engine_itl.py: the engines' own inter-token latency, read from real Prometheus
endpoints (prometheus_client's exposition of a histogram named as vLLM's, on 127.0.0.1); and
pdserve/bench/local_cluster.py's metrics URLs the workers log."""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from pdserve.bench import engine_itl
from pdserve.bench.local_cluster import worker_metrics_urls

ITL = "vllm:inter_token_latency_seconds"


@contextlib.contextmanager
def exposed(registry: CollectorRegistry) -> Iterator[str]:
    """`registry`'s /metrics URL on 127.0.0.1 while the block runs."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def engines():
    """Two engines' /metrics URLs and each one's ITL histogram (labelled as vLLM's)."""
    registries = [CollectorRegistry() for _ in range(2)]
    histograms = [
        Histogram(ITL, "ITL", ["engine"], registry=registry).labels(engine="0")
        for registry in registries
    ]
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(exposed(registry)) for registry in registries], histograms


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
    itl = Histogram(ITL, "ITL", registry=registry)
    with exposed(registry) as url:
        before = engine_itl.totals([url])
        itl.observe(0.05)
        assert engine_itl.mean_between(before, engine_itl.totals([url])) == pytest.approx(0.05)


def test_each_workers_last_logged_metrics_url(tmp_path: Path):
    (tmp_path / "decode-11.log").write_text(
        "x metrics on http://127.0.0.1:1001/metrics\nrestarted\n"
        "x metrics on http://127.0.0.1:1002/metrics\n"
    )
    (tmp_path / "prefill-12.log").write_text("x metrics on http://127.0.0.1:2001/metrics\n")
    (tmp_path / "serve.log").write_text("pdserve ready\n")
    assert worker_metrics_urls(tmp_path) == [
        "http://127.0.0.1:1002/metrics",
        "http://127.0.0.1:2001/metrics",
    ]


def test_an_engine_that_does_not_answer_is_an_error_not_a_zero():
    with pytest.raises(httpx.ConnectError):  # nothing listens on the discard port
        engine_itl.totals(["http://127.0.0.1:9/metrics"], timeout_s=2)
