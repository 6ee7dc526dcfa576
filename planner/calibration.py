"""Fit a LinearCost from what `pdserve bench` measured on the real engine.

A bench JSON has, per request, its send time, TTFT, every inter-token gap and its token
counts; that is enough to recover step times without instrumenting the engine:
- prefill = a + b · prompt tokens, by least squares over the TTFTs of requests whose prefill
  ran alone (sent after every earlier request had its first token), so queueing is left out;
  with pdserve's default admission the first token comes from the prefill worker, so such a
  TTFT is one prefill step plus fixed overheads (HTTP, tokenization), which land in `a`;
- decode = c + d · batch, by least squares over the inter-token gaps, each paired with the
  number of requests on the decode worker (between their second and last token) at the gap's
  midpoint. Each request's first gap is left out: it holds the KV transfer and admission.
A slope that comes out negative (noise, or interference on a shared host) is no step time a
worker has: the fit is then flat, at the mean.
A useful calibration has prompts of several lengths sent one at a time, and bursts that put
several requests in the decode batch at once (see scripts/validate_simulator.py).
"""

import json
from pathlib import Path

import numpy as np

from planner.cost_model import LinearCost


def load_requests(paths: list[str | Path]) -> list[list[dict]]:
    """The `requests` of each bench JSON, one list per file (a file is one benchmark run)."""
    return [json.loads(Path(path).read_text())["requests"] for path in paths]


def fit_linear_cost(runs: list[list[dict]]) -> LinearCost:
    """Fit from one or more benchmark runs, each a list of request entries as in a bench JSON
    (`send_time`, `ttft`, `itl`, `e2e`, `input_tokens`, `error`). Runs are kept apart because
    their send times count from each run's own start."""
    prefill_points, decode_points = [], []
    for run in runs:
        done = sorted((r for r in run if r["error"] is None), key=lambda r: r["send_time"])
        prefill_points += _lone_prefills(done)
        decode_points += _decode_gaps(done)
    a, b = _line(prefill_points, "prefill (TTFTs of requests sent one at a time)")
    c, d = _line(decode_points, "decode (inter-token gaps)")
    return LinearCost(a, b, c, d)


def _lone_prefills(done: list[dict]) -> list[tuple[float, float]]:
    """(prompt tokens, TTFT) of requests sent after every earlier one had its first token."""
    points, busy_until = [], -np.inf
    for request in done:
        if request["send_time"] >= busy_until:
            points.append((request["input_tokens"], request["ttft"]))
        busy_until = max(busy_until, request["send_time"] + request["ttft"])
    return points


def _decode_gaps(done: list[dict]) -> list[tuple[float, float]]:
    """(requests decoding, gap) for every inter-token gap after a request's first one."""
    spans = [
        (r["send_time"] + r["ttft"] + r["itl"][0], r["send_time"] + r["e2e"])
        for r in done
        if r["itl"]
    ]
    points = []
    for request in done:
        token_time = request["send_time"] + request["ttft"]
        for i, gap in enumerate(request["itl"]):
            token_time += gap
            if i == 0:
                continue
            middle = token_time - gap / 2
            points.append((sum(first <= middle <= last for first, last in spans), gap))
    return points


def _line(points: list[tuple[float, float]], what: str) -> tuple[float, float]:
    """Least-squares intercept and slope; flat at the mean for a single x value or a negative
    slope."""
    if not points:
        raise ValueError(f"no samples to fit {what}")
    x, y = np.asarray(points, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, 0.0)
    if slope <= 0:
        return float(y.mean()), 0.0
    return float(intercept), float(slope)
