"""What Kubernetes and Prometheus see of real workers: the standard gRPC health service answers
NOT_SERVING while the engine loads and SERVING once it is ready; each worker's /metrics carries
vLLM's engine series and pdserve's KV transfer series after a disaggregated request; and every
query of the Grafana dashboard names a metric this running cluster exports."""

import json
import re
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.bench.local_cluster import WORKER_METRICS_URL
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings.cluster_secret import secret_metadata
from pdserve.worker.grpc_health import LIVENESS, READINESS
from pdserve.worker.processes import free_port, spawn, stop_group, wait_until
from tests.integration.conftest import KV_CACHE_GIB, SERVED_MODEL
from tests.integration.helpers import metrics_url, scrape, total
from tests.integration.http_client import HTTP
from tests.integration.prompts import DISAGGREGATED_MAX_TOKENS, DISAGGREGATED_PROMPTS

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/pdserve-dashboard.json"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
METRIC_NAME = re.compile(r"(?<![\w:])(pdserve_\w+|vllm:[\w:]+|up(?=\{))")
PROMETHEUS_MADE = {"up"}
SUFFIXES = ("_bucket", "_count", "_sum")  # series Prometheus adds to every target itself
FROZEN = re.compile(r"startup heap frozen: (\d+) objects")


def health(address: str, service: str) -> int:
    """One grpc.health.v1 Check, as a kubelet's gRPC probe makes it: no metadata."""
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return reply.status


def exported(url: str) -> set[str]:
    """The series names a target exports, also for families with no sample yet (a labelled
    counter appears at its first increment): each TYPE line's name, with a histogram's
    _bucket, _count and _sum."""
    found = set()
    for line in HTTP.get(url, timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            found |= {name} | ({f"{name}{s}" for s in SUFFIXES} if kind == "histogram" else set())
        elif line and not line.startswith("#"):
            found.add(line.split("{", 1)[0].split(" ", 1)[0])
    return found


def names(samples: dict[str, float]) -> set[str]:
    return {series.split("{", 1)[0] for series in samples}


def test_a_loading_worker_is_alive_but_not_serving(smollm2_dir, tmp_path):
    """The gRPC port opens before the engine loads (~30 s): readiness says NOT_SERVING while
    the worker's own Health says STARTING. The worker is stopped before its engine is up."""
    port, metrics_port = free_port(), free_port()
    log_path = tmp_path / "worker.log"
    process = spawn(
        [sys.executable, "-m", "pdserve.cli", "worker", "--port", str(port),
         "--metrics-port", str(metrics_port), "--kv-cache-gib", KV_CACHE_GIB],
        log_path,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        wait_until(lambda: WORKER_METRICS_URL.search(log_path.read_text()), process, 60, "worker")
        wait_until(lambda: _answers(address), process, 60, "worker's gRPC port")
        with grpc.insecure_channel(address) as channel:
            state = worker_pb2_grpc.WorkerStub(channel).Health(
                worker_pb2.HealthRequest(), metadata=secret_metadata(), timeout=5
            )
        readiness, liveness = health(address, READINESS), health(address, LIVENESS)
        samples = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        stop_group(process.pid, grace_s=1, process=process)
    assert state.state == worker_pb2.HealthReply.STARTING, state
    assert (readiness, liveness) == (NOT_SERVING, SERVING)
    assert samples['pdserve_worker_state{role="colocated",state="starting"}'] == 1.0
    assert samples['pdserve_worker_state{role="colocated",state="ready"}'] == 0.0


def _answers(address: str) -> bool:
    try:
        health(address, LIVENESS)
    except grpc.RpcError:
        return False
    return True


def test_ready_workers_serve_health_and_metrics_and_the_dashboard_names_them(server):
    workers = {row["role"]: row["address"] for row in server.workers()}
    for address in workers.values():
        assert health(address, READINESS) == SERVING
        assert health(address, LIVENESS) == SERVING
    with pytest.raises(grpc.RpcError) as unknown:
        health(workers["decode"], "no-such-service")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    response = HTTP.post(
        f"{server.base_url}/completions",
        headers={"x-pdserve-route": "disaggregated"},
        json={
            "model": SERVED_MODEL,
            "prompt": DISAGGREGATED_PROMPTS[3],
            "max_tokens": DISAGGREGATED_MAX_TOKENS,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    scrapes = {
        role: scrape(metrics_url(server, role, address)) for role, address in workers.items()
    }
    for role, samples in scrapes.items():
        assert samples[f'pdserve_worker_state{{role="{role}",state="ready"}}'] == 1.0
        assert total(samples, "vllm:request_success_total") >= 1, role
        assert total(samples, "vllm:prompt_tokens_total") >= prompt_tokens, role
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                     "vllm:iteration_tokens_total_bucket"):  # fmt: skip
            assert name in names(samples), (role, name)
    decode = scrapes["decode"]
    # One host, two CPU workers: `auto` picks shared memory.
    assert decode['pdserve_worker_kv_transfer_bytes_total{transport="shm"}'] > 0
    assert decode['pdserve_worker_kv_transfer_seconds_count{transport="shm"}'] >= 1

    known = exported(f"{server.url}/metrics") | PROMETHEUS_MADE
    for role, address in workers.items():
        known |= exported(metrics_url(server, role, address))
    missing = {
        (panel["title"], name)
        for panel, expr in dashboard_queries()
        for name in metric_names(expr)
        if name not in known
    }
    assert not missing, f"dashboard queries name metrics no component exports: {missing}"


def frozen_heaps(log_dir: Path) -> dict[str, int]:
    """Each process's count of frozen objects, by its log's name."""
    frozen = {}
    for path in sorted(log_dir.glob("*.log")):
        counts = FROZEN.findall(path.read_text(errors="replace"))
        if counts:
            frozen[path.name.split("-")[0].removesuffix(".log")] = int(counts[-1])
    return frozen


def test_the_router_and_every_worker_serve_with_their_startup_heap_frozen(server):
    """pdserve/core/heap.py: each process exempts the heap it holds once it serves from the
    collector's full passes (a worker's, with vLLM and torch imported, took ~300 ms each). A
    lone router runs in `pdserve serve`'s own process (serve.log), and freezes its heap within
    a tenth of a second of serving."""
    expected = {"serve", "prefill", "decode"}
    wait_until(lambda: set(frozen_heaps(server.log_dir)) == expected, server.process, 10, "frozen")
    frozen = frozen_heaps(server.log_dir)
    assert frozen["serve"] > 10_000 and frozen["prefill"] > 100_000 < frozen["decode"], frozen


def dashboard_queries():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queries = [(panel, target["expr"]) for panel in panels for target in panel.get("targets", ())]
    assert len(queries) >= 10
    return queries


def metric_names(expr: str) -> set[str]:
    """The metrics a query names: pdserve's, vLLM's, and Prometheus' `up` (the dashboard's only
    series; label names and PromQL functions never start so)."""
    return set(METRIC_NAME.findall(expr))
