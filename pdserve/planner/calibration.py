"""Step costs measured on a real cluster: fitted from what `pdserve bench` recorded, and kept in
a calibration file that `pdserve plan --calibration` reads instead of the roofline.

A bench JSON has, per request, its send time, TTFT, every inter-token gap and its token
counts; that is enough to recover step times without instrumenting the engine:
- prefill = (a + b · prompt tokens) · (1 + k_p · f), by least squares over the TTFTs of requests
  whose prefill ran alone on the prefill worker (no other request waited for its first token
  meanwhile), so queueing and batched prompts are left out; f is the share of that TTFT during
  which other requests were decoding. With pdserve's default admission the first token comes
  from the prefill worker, so such a TTFT is one prefill step plus fixed overheads (HTTP,
  tokenization), which land in `a`;
- decode = (c + d · batch) · (1 + k_d · f), over the inter-token gaps, each paired with the
  number of requests on the decode worker (between their second and last token) at the gap's
  midpoint, and f the share of the gap during which another request waited for its first token
  (a prefill ran). Each request's first gap is left out: it holds the KV transfer and admission.
a, b, c, d come from the samples with f < `IDLE_SHARE` (the neighbour idle); k_p and k_d, the
contention of a shared host (two engines on the same cores, and the router, client and KV
transfer they drive), from the rest (0 when there are none).
A slope that comes out negative (noise, or interference on a shared host) is no step time a
worker has: the fit is then flat, at the mean.
A useful calibration has prompts of several lengths sent one at a time, bursts that put several
requests in the decode batch at once, and prompts sent while a batch decodes (see
scripts/validate_simulator.py, whose --write-calibration makes the file).
"""

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from pdserve.costs.step_costs import StepCosts

IDLE_SHARE = 0.1
FORMAT = "pdserve-calibration/2"
_KINDS = {str: (str, "a string"), int: (int, "an integer"), float: ((int, float), "a number")}


@dataclass(frozen=True)
class FittedSteps:
    cost: StepCosts
    prefill_contention: float  # k_p: a prefill step's slowdown while the neighbour decodes
    decode_contention: float  # k_d: a decode step's slowdown while the neighbour prefills


@dataclass(frozen=True)
class Calibration:
    """One worker's measured step costs and how the workers of one host slowed each other;
    what a calibration file holds (flat JSON of these fields plus "format"). In the search a
    GPU stands for one worker of this size, and `workers_per_host` of them share a host. The
    `alone_*` costs are those of one worker with the whole host to itself (every core: the
    one-worker colocated layout, planner.host_layouts); equal to the others when
    `workers_per_host` is 1, or when they were not measured."""

    model: str
    measured_on: str  # free text: the host and cluster it was measured on
    prefill_base_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_request_s: float
    prefill_contention: float
    decode_contention: float
    workers_per_host: int
    kv_capacity_tokens: int  # per worker
    block_size: int
    alone_prefill_base_s: float
    alone_prefill_per_token_s: float
    alone_decode_base_s: float
    alone_decode_per_request_s: float

    @classmethod
    def from_fit(
        cls, fitted: FittedSteps, alone: FittedSteps | None = None, **rest
    ) -> "Calibration":
        """From the fit of workers sharing the host and, if measured, of one worker alone on
        it (its contention is its own prefills slowing its decodes: the simulator models those
        steps itself)."""
        cost, lone = fitted.cost, (alone or fitted).cost
        return cls(
            prefill_base_s=cost.prefill_base_s,
            prefill_per_token_s=cost.prefill_s_per_token,
            decode_base_s=cost.decode_base_s,
            decode_per_request_s=cost.decode_s_per_sequence,
            prefill_contention=fitted.prefill_contention,
            decode_contention=fitted.decode_contention,
            alone_prefill_base_s=lone.prefill_base_s,
            alone_prefill_per_token_s=lone.prefill_s_per_token,
            alone_decode_base_s=lone.decode_base_s,
            alone_decode_per_request_s=lone.decode_s_per_sequence,
            **rest,
        )

    @property
    def cost(self) -> StepCosts:
        return StepCosts(
            prefill_s_per_token=self.prefill_per_token_s,
            decode_base_s=self.decode_base_s,
            decode_s_per_sequence=self.decode_per_request_s,
            prefill_base_s=self.prefill_base_s,
        )

    @property
    def alone_cost(self) -> StepCosts:
        return StepCosts(
            prefill_s_per_token=self.alone_prefill_per_token_s,
            decode_base_s=self.alone_decode_base_s,
            decode_s_per_sequence=self.alone_decode_per_request_s,
            prefill_base_s=self.alone_prefill_base_s,
        )

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"format": FORMAT, **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Raises ValueError naming the file and what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not JSON: {error}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'{path}: not a calibration file (needs "format": "{FORMAT}")')
        values = {}
        for field in fields(cls):
            value = data.get(field.name)
            kind, what = _KINDS[field.type]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ValueError(f"{path}: {field.name!r} must be {what}")
            if kind is not str and value < 0:
                raise ValueError(f"{path}: {field.name!r} must not be negative")
            values[field.name] = float(value) if field.type is float else value
        if values["workers_per_host"] < 1 or values["block_size"] < 1:
            raise ValueError(f"{path}: workers_per_host and block_size must be at least 1")
        return cls(**values)


def load_requests(paths: list[str | Path]) -> list[list[dict]]:
    """The `requests` of each bench JSON, one list per file (a file is one benchmark run)."""
    return [json.loads(Path(path).read_text())["requests"] for path in paths]


def fit_steps(runs: list[list[dict]]) -> FittedSteps:
    """Fit from one or more benchmark runs, each a list of request entries as in a bench JSON
    (`send_time`, `ttft`, `itl`, `e2e`, `input_tokens`, `error`). Runs are kept apart because
    their send times count from each run's own start."""
    prefill_points, decode_points = [], []
    for run in runs:
        done = sorted((r for r in run if r["error"] is None), key=lambda r: r["send_time"])
        prefill_points += _lone_prefills(done)
        decode_points += _decode_gaps(done)
    (a, b), k_p = _contended_line(prefill_points, "prefill (TTFTs of requests sent one at a time)")
    (c, d), k_d = _contended_line(decode_points, "decode (inter-token gaps)")
    cost = StepCosts(
        prefill_s_per_token=b, decode_base_s=c, decode_s_per_sequence=d, prefill_base_s=a
    )
    return FittedSteps(cost, k_p, k_d)


def _prefilling(request: dict) -> tuple[float, float]:
    return request["send_time"], request["send_time"] + request["ttft"]


def _decoding(request: dict) -> tuple[float, float]:
    return request["send_time"] + request["ttft"], request["send_time"] + request["e2e"]


def _lone_prefills(done: list[dict]) -> list[tuple[float, float, float]]:
    """(prompt tokens, TTFT, share of it others decoded) of requests whose wait for their first
    token overlapped no other request's: sent after every earlier one had its first token, and
    before the next was sent. (Of a burst sent at once, the first sent is not alone: the engine
    prefills the burst in one step, and its TTFT is that step's.)"""
    points = []
    for request in done:
        start, end = _prefilling(request)
        others = [other for other in done if other is not request]
        if any(_prefilling(o)[0] < end and _prefilling(o)[1] > start for o in others):
            continue
        share = _busy_share(start, end, [_decoding(other) for other in others])
        points.append((request["input_tokens"], request["ttft"], share))
    return points


def _decode_gaps(done: list[dict]) -> list[tuple[float, float, float]]:
    """(requests decoding, gap, share of it another prompt prefilled) for every inter-token gap
    after a request's first one."""
    spans = [
        (r["send_time"] + r["ttft"] + r["itl"][0], r["send_time"] + r["e2e"])
        for r in done
        if r["itl"]
    ]
    points = []
    for request in done:
        prefills = [_prefilling(other) for other in done if other is not request]
        token_time = request["send_time"] + request["ttft"]
        for i, gap in enumerate(request["itl"]):
            token_time += gap
            if i == 0:
                continue
            middle = token_time - gap / 2
            batch = sum(first <= middle <= last for first, last in spans)
            points.append((batch, gap, _busy_share(token_time - gap, token_time, prefills)))
    return points


def _busy_share(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Share of [start, end] covered by the union of `intervals`."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for first, last in sorted(intervals):
        first, last = max(first, reach), min(last, end)
        if last > first:
            covered += last - first
            reach = last
    return covered / (end - start)


def _contended_line(
    points: list[tuple[float, float, float]], what: str
) -> tuple[tuple[float, float], float]:
    """((intercept, slope), contention): the line through the samples taken with the neighbour
    idle (all of them if there are none such), and k fitting y = line(x) · (1 + k · share) by
    least squares over the others."""
    if not points:
        raise ValueError(f"no samples to fit {what}")
    idle = [(x, y) for x, y, share in points if share < IDLE_SHARE]
    intercept, slope = _line(idle or [(x, y) for x, y, _ in points])
    busy = [(x, y, share) for x, y, share in points if share >= IDLE_SHARE]
    if not idle or not busy:
        return (intercept, slope), 0.0
    excess = np.array([y / (intercept + slope * x) - 1 for x, y, _ in busy])
    shares = np.array([share for _, _, share in busy])
    return (intercept, slope), max(0.0, float(excess @ shares / (shares @ shares)))


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope; flat at the mean for a single x value or a negative
    slope; through the origin for a negative intercept (seen here on prefill, whose cost is
    convex in length: a step of a short prompt would take no time, or less)."""
    x, y = np.asarray(points, dtype=float).T
    slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, 0.0)
    if slope <= 0:
        return float(y.mean()), 0.0
    if intercept < 0:
        return 0.0, float(x @ y / (x @ x))
    return float(intercept), float(slope)
