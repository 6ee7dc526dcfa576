"""What several integration tests do the same way: a greedy completion steered onto a route, the
Prometheus samples of the router and of a worker, and the first parent of the pools' block keys.
(Processes, prompts and the HTTP client have modules of their own.)"""

import httpx

from pdserve.bench.local_cluster import WORKER_METRICS_URL
from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP
from tests.integration.prompts import DISAGGREGATED_MAX_TOKENS


def complete(
    server, prompt: str, route: str, max_tokens: int = DISAGGREGATED_MAX_TOKENS, **extra
) -> httpx.Response:
    """A greedy completion through `server`'s router, steered onto `route` (x-pdserve-route),
    with the timing breakdown in its body; `extra` goes into the request body."""
    return complete_at(server.base_url, prompt, route, max_tokens, **extra)


def complete_at(
    base_url: str, prompt: str, route: str, max_tokens: int = DISAGGREGATED_MAX_TOKENS, **extra
) -> httpx.Response:
    """`complete` through the router at `base_url` (its OpenAI prefix, .../v1)."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }
    return HTTP.post(
        f"{base_url}/completions",
        json=body,
        timeout=300,
        headers={"x-pdserve-route": route, "x-pdserve-timing": "1"},
    )


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text scrape: 'name{labels}' -> value."""
    samples = {}
    for line in HTTP.get(url, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    """The sum of a metric's samples over all its labels."""
    return sum(value for series, value in samples.items() if series.split("{", 1)[0] == name)


def metrics_url(server, role: str, address: str) -> str:
    """A worker logs its metrics URL; `serve` names its log after its role and gRPC port."""
    log_path = server.log_dir / f"{role}-{address.rsplit(':', 1)[1]}.log"
    (url,) = WORKER_METRICS_URL.findall(log_path.read_text())
    return url


def router_sample(server, series: str) -> float:
    """One series of the router's metrics, 'name{labels}' (0 when it has not been counted yet)."""
    return scrape(f"{server.url}/metrics").get(series, 0.0)


def router_total(server, name: str) -> float:
    """A metric of the router's, summed over all its labels."""
    return total(scrape(f"{server.url}/metrics"), name)


def first_parent(server) -> bytes:
    """The first block's parent in vLLM's sha256 block hash, as the workers' engines have it
    (the router's copies of the pools say it: it computes keys with it too)."""
    copies = HTTP.get(f"{server.url}/pdserve/workers", timeout=30).json()["kv_pools"]
    (parent,) = {row["first_parent"] for row in copies}
    return bytes.fromhex(parent)
