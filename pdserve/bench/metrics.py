"""The benchmark summary, computed from request records and the benchmark duration.

Definitions follow `vllm bench serve` (vllm/benchmarks/serve.py `calculate_metrics`):
- throughputs divide by the benchmark duration (start of the send schedule to the last
  completion) and count successful requests only (their server-reported token counts);
- TTFT, ITL and E2E statistics are over successful requests, ITL pooled over all of them;
- TPOT = (E2E - TTFT) / (output tokens - 1), left out of the statistics for 1-token outputs;
- percentiles interpolate linearly between the closest ranks (numpy's default, which vLLM
  uses); std is the population std (numpy's default);
- goodput = requests meeting every SLO / duration; a 1-token output counts TPOT as 0 there.
Differences: a statistic with no samples is None here (vLLM reports 0), and `slo_attainment`
(good requests / all requests, failed ones included) is added.

Prefix hit rates are over successful requests: measured, the server's cached prompt tokens
(`usage.prompt_tokens_details.cached_tokens`) / prompt tokens, None when the server does not
report them; the bound, what an infinite prefix cache would hold of the same prompts
(bench.infinite_cache), None where the workload cannot compute it. A workload with turns (the
conversation workload) also gets both, and TTFT, per turn number.
"""

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.bench.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Distribution:
    """Statistics of one latency, in seconds; None where there were no samples."""

    count: int
    mean: float | None = None
    std: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`th percentile (0-100), interpolated linearly between the closest ranks as numpy's
    default and vLLM's bench do, so every pdserve bench and script reports the same statistic;
    NaN (a table's blank) when there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        return Distribution(count=0)
    p50, p90, p95, p99 = (percentile(values, q) for q in PERCENTILES)
    mean = statistics.fmean(values)
    # The population std as numpy computes it (statistics.pstdev is exact, and slow on pooled ITL).
    std = math.sqrt(statistics.fmean((v - mean) ** 2 for v in values))
    return Distribution(len(values), mean, std, p50, p90, p95, p99)


_SLO_ITEM = re.compile(r"^(ttft|tpot|e2e)=([0-9]*\.?[0-9]+)(ms|s)?$")


@dataclass
class Slo:
    """Latency objectives in seconds; a request meets the SLO if it succeeded and met each one
    set."""

    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Slo":
        """Parse "ttft=500ms,tpot=50ms" or "ttft=0.5,e2e=10s" (a bare number is seconds)."""
        values: dict[str, float] = {}
        for item in text.replace(" ", "").split(","):
            match = _SLO_ITEM.match(item)
            if not match:
                raise ValueError(
                    f"bad SLO item {item!r}: expected ttft|tpot|e2e=NUMBER[ms|s], "
                    'e.g. "ttft=500ms,tpot=50ms"'
                )
            name, number, unit = match.groups()
            if name in values:
                raise ValueError(f"SLO {name!r} given twice")
            values[name] = float(number) / (1000.0 if unit == "ms" else 1.0)
        return cls(**values)

    def met_by(self, record: RequestRecord) -> bool:
        if not record.ok:
            return False
        tpot = record.tpot or 0.0  # as vLLM: a 1-token output has no TPOT, so it cannot miss it
        checks = ((self.ttft, record.ttft), (self.tpot, tpot), (self.e2e, record.e2e))
        return all(limit is None or value <= limit for limit, value in checks)


@dataclass
class TurnSummary:
    """The requests of one turn number (0: every conversation's first)."""

    turn: int
    requests: int
    failed: int
    ttft: Distribution
    prefix_hit_rate: float | None
    infinite_cache_hit_rate: float | None


@dataclass
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # successful requests / s
    output_throughput: float  # output tokens of successful requests / s
    total_token_throughput: float  # (input + output) tokens of successful requests / s
    prefix_hit_rate: float | None  # prompt tokens served from a prefix cache / all prompt tokens
    infinite_cache_hit_rate: float | None  # the same, from an infinite prefix cache
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    slo: Slo | None = None
    good_requests: int | None = None
    goodput: float | None = None  # requests meeting the SLO / s
    slo_attainment: float | None = None  # requests meeting the SLO / all requests
    turns: list[TurnSummary] = field(default_factory=list)  # per turn number, when there are turns


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples, in seconds, over successful requests: TTFT, TPOT (requests with at
    least 2 output tokens), ITL (every gap of every request, pooled) and E2E."""
    done = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [r.tpot for r in done if r.tpot is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2e": [r.e2e for r in done],
    }


def prefix_hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens of the successful requests whose server said."""
    reported = [r for r in records if r.ok and r.cached_tokens is not None]
    tokens = sum(r.input_tokens for r in reported)
    return sum(r.cached_tokens for r in reported) / tokens if tokens else None


def infinite_cache_hit_rate(records: list[RequestRecord]) -> float | None:
    """What an infinite prefix cache would hold / prompt tokens, over the successful requests;
    None unless the workload computed it for each of them."""
    done = [r for r in records if r.ok]
    tokens = sum(r.input_tokens for r in done)
    if not tokens or any(r.cacheable_tokens is None for r in done):
        return None
    return sum(min(r.cacheable_tokens, r.input_tokens) for r in done) / tokens


def per_turn(records: list[RequestRecord]) -> list[TurnSummary]:
    summaries = []
    for turn in sorted({r.turn for r in records if r.turn is not None}):
        these = [r for r in records if r.turn == turn]
        summaries.append(
            TurnSummary(
                turn=turn,
                requests=len(these),
                failed=sum(not r.ok for r in these),
                ttft=distribution(latency_samples(these)["ttft"]),
                prefix_hit_rate=prefix_hit_rate(these),
                infinite_cache_hit_rate=infinite_cache_hit_rate(these),
            )
        )
    return summaries


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo | None = None) -> Summary:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    done = [r for r in records if r.ok]
    samples = latency_samples(records)
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = Summary(
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        prefix_hit_rate=prefix_hit_rate(records),
        infinite_cache_hit_rate=infinite_cache_hit_rate(records),
        ttft=distribution(samples["ttft"]),
        tpot=distribution(samples["tpot"]),
        itl=distribution(samples["itl"]),
        e2e=distribution(samples["e2e"]),
        turns=per_turn(records),
    )
    if slo is not None:
        good = sum(slo.met_by(r) for r in records)
        summary.slo = slo
        summary.good_requests = good
        summary.goodput = good / duration_s
        summary.slo_attainment = good / len(records) if records else None
    return summary
