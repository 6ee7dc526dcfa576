"""Metric definitions, SLO parsing and arrival schedules of `pdserve bench`, on hand-built
records checked against hand-computed numbers, and against vLLM's own `calculate_metrics`."""

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.metrics import Slo, distribution, percentile, summarize
from pdserve.bench.records import RequestRecord

pytestmark = pytest.mark.timeout(60)

DURATION = 2.0


def hand_built_records() -> list[RequestRecord]:
    return [
        # 4 tokens (server usage): TPOT = (0.2 - 0.1) / 3
        RequestRecord(
            10,
            8,
            0.0,
            ttft=0.1,
            itl=[0.02, 0.03, 0.05],
            e2e=0.2,
            output_chunks=4,
            usage={"prompt_tokens": 12, "completion_tokens": 4},
        ),
        # 1 token: no TPOT (left out of the TPOT statistics)
        RequestRecord(
            5,
            8,
            0.1,
            ttft=0.3,
            itl=[],
            e2e=0.3,
            output_chunks=1,
            usage={"prompt_tokens": 5, "completion_tokens": 1},
        ),
        # no usage: 3 text chunks count as 3 tokens, TPOT = (0.4 - 0.2) / 2
        RequestRecord(6, 8, 0.2, ttft=0.2, itl=[0.1, 0.1], e2e=0.4, output_chunks=3),
        RequestRecord(7, 8, 0.3, error="HTTP 500: boom"),
    ]


def test_summary_matches_hand_computed_numbers():
    s = summarize(hand_built_records(), DURATION)
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (12 + 5 + 6, 4 + 1 + 3)
    assert s.request_throughput == pytest.approx(3 / 2)
    assert s.output_throughput == pytest.approx(8 / 2)
    assert s.total_token_throughput == pytest.approx((23 + 8) / 2)

    assert s.ttft.count == 3 and s.ttft.mean == pytest.approx(0.2)
    assert s.ttft.p50 == pytest.approx(0.2)
    assert s.ttft.p90 == pytest.approx(0.28)  # linear interpolation over [0.1, 0.2, 0.3]
    assert s.ttft.p99 == pytest.approx(0.298)
    assert s.tpot.count == 2 and s.tpot.mean == pytest.approx((0.1 / 3 + 0.1) / 2)
    assert (
        s.itl.count == 5 and s.itl.mean == pytest.approx(0.06) and s.itl.p50 == pytest.approx(0.05)
    )
    assert s.e2e.mean == pytest.approx(0.3) and s.e2e.std == pytest.approx(math.sqrt(2 / 300))
    assert s.goodput is None and s.slo_attainment is None


def test_goodput_counts_failures_as_missing_the_slo():
    records = hand_built_records()
    s = summarize(records, DURATION, Slo(ttft=0.25, tpot=0.05))
    # only the first meets both; the second misses TTFT, the third TPOT, the fourth failed
    assert s.good_requests == 1
    assert s.goodput == pytest.approx(1 / DURATION)
    assert s.slo_attainment == pytest.approx(1 / 4)
    # a 1-token output has no TPOT, so (as in vLLM) it cannot miss a TPOT objective
    assert [Slo(tpot=0.01).met_by(r) for r in records] == [False, True, False, False]
    assert summarize(records, DURATION, Slo(e2e=0.35)).good_requests == 2


def test_record_token_counts_prefer_server_usage():
    record = RequestRecord(3, 8, ttft=0.1, e2e=0.5, output_chunks=2, usage={"completion_tokens": 5})
    assert record.output_tokens == 5 and record.input_tokens == 3
    assert record.tpot == pytest.approx(0.4 / 4)


def test_empty_statistics_are_none():
    s = summarize([RequestRecord(1, 1, error="timed out")], 1.0, Slo(ttft=1.0))
    assert s.ttft.count == 0 and s.ttft.mean is None and s.e2e.p99 is None
    assert s.request_throughput == 0 and s.good_requests == 0 and s.slo_attainment == 0
    assert distribution([1.0, 2.0, 3.0, 4.0]).p50 == pytest.approx(2.5)


def turn_record(turn, prompt, cached, cacheable, ttft=0.1, error=None) -> RequestRecord:
    """A conversation turn; `cached` None: the server did not report cached tokens."""
    usage = {"prompt_tokens": prompt, "completion_tokens": 2}
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return RequestRecord(
        prompt, 2, ttft=ttft, e2e=ttft + 0.1, output_chunks=2, usage=usage, error=error,
        turn=turn, cacheable_tokens=cacheable,
    )  # fmt: skip


def test_prefix_hit_rates_overall_and_per_turn():
    records = [
        turn_record(0, 100, 0, 0, ttft=0.4),
        turn_record(0, 100, 50, 0, ttft=0.6),
        turn_record(1, 200, 150, 180, ttft=0.1),
        turn_record(1, 300, 0, 250, ttft=0.2),
        turn_record(1, 999, 999, 999, error="HTTP 500: boom"),  # failed: out of the rates
        turn_record(2, 400, None, 350),  # not reported: out of the measured rate only
    ]
    s = summarize(records, DURATION)
    assert s.prefix_hit_rate == pytest.approx((50 + 150) / (100 + 100 + 200 + 300))
    assert s.infinite_cache_hit_rate == pytest.approx((180 + 250 + 350) / 1100)
    assert [(t.turn, t.requests, t.failed, t.ttft.count) for t in s.turns] == [
        (0, 2, 0, 2),
        (1, 3, 1, 2),
        (2, 1, 0, 1),
    ]
    assert s.turns[0].ttft.p50 == pytest.approx(0.5) and s.turns[0].ttft.p90 == pytest.approx(0.58)
    assert [t.prefix_hit_rate for t in s.turns] == pytest.approx([0.25, 0.3, None])
    assert [t.infinite_cache_hit_rate for t in s.turns] == pytest.approx([0.0, 0.86, 0.875])


def test_hit_rates_that_cannot_be_known_are_none():
    s = summarize([turn_record(0, 10, None, 5), turn_record(0, 10, None, None)], DURATION)
    assert s.prefix_hit_rate is None  # no server said
    assert s.infinite_cache_hit_rate is None  # the workload did not compute it for each request
    assert summarize(hand_built_records(), DURATION).turns == []  # no turns: no per-turn rows
    # A cache cannot hold more than the prompt: the bound is capped at the prompt's tokens.
    assert summarize([turn_record(1, 10, 10, 11)], DURATION).infinite_cache_hit_rate == 1.0


def test_agrees_with_vllm_calculate_metrics():
    serve = pytest.importorskip("vllm.benchmarks.serve")
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    records = [
        r for r in hand_built_records() if r.usage or r.error
    ]  # vLLM counts 1 token without usage
    outputs = [
        RequestFuncOutput(
            success=r.ok,
            latency=r.e2e or 0.0,
            output_tokens=r.output_tokens,
            ttft=r.ttft or 0.0,
            itl=r.itl,
            prompt_len=r.input_tokens,
            start_time=r.send_time,
            error=r.error or "",
        )
        for r in records
    ]
    theirs, _ = serve.calculate_metrics(
        [], outputs, DURATION, None, [50, 90, 95, 99], {"ttft": 250, "tpot": 50}
    )
    ours = summarize(records, DURATION, Slo(ttft=0.25, tpot=0.05))
    assert (ours.completed, ours.failed) == (theirs.completed, theirs.failed)
    assert (ours.total_input_tokens, ours.total_output_tokens) == (
        theirs.total_input,
        theirs.total_output,
    )
    for name in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert getattr(ours, name) == pytest.approx(getattr(theirs, name))
    assert ours.goodput == pytest.approx(theirs.request_goodput)
    for ours_key, theirs_key in (
        ("ttft", "ttft"),
        ("tpot", "tpot"),
        ("itl", "itl"),
        ("e2e", "e2el"),
    ):
        d = getattr(ours, ours_key)
        assert d.mean * 1000 == pytest.approx(getattr(theirs, f"mean_{theirs_key}_ms"))
        assert d.std * 1000 == pytest.approx(getattr(theirs, f"std_{theirs_key}_ms"))
        assert d.p50 * 1000 == pytest.approx(getattr(theirs, f"median_{theirs_key}_ms"))
        percentiles = dict(getattr(theirs, f"percentiles_{theirs_key}_ms"))
        for p in (50, 90, 95, 99):
            assert getattr(d, f"p{p}") * 1000 == pytest.approx(percentiles[p])


@pytest.mark.parametrize(
    "text, expected",
    [
        ("ttft=500ms,tpot=50ms", Slo(ttft=0.5, tpot=0.05)),
        ("ttft=0.5", Slo(ttft=0.5)),
        ("e2e=10s, tpot=.02", Slo(tpot=0.02, e2e=10.0)),
    ],
)
def test_slo_parsing(text, expected):
    assert Slo.parse(text) == expected


@pytest.mark.parametrize(
    "text", ["", "ttft", "ttft=fast", "ttft=5min", "latency=1", "ttft=1,ttft=2", "ttft=-1"]
)
def test_slo_parsing_rejects_bad_input(text):
    with pytest.raises(ValueError):
        Slo.parse(text)


def gap_cv(burstiness: float, n: int = 4000) -> float:
    gaps = np.diff([0.0, *arrival_times(n, 10.0, burstiness, seed=1)])
    return float(gaps.std() / gaps.mean())


def test_poisson_arrivals_are_seeded_at_the_requested_rate():
    times = arrival_times(4000, 10.0, seed=7)
    assert times == arrival_times(4000, 10.0, seed=7) and times != arrival_times(4000, 10.0, seed=8)
    assert all(b >= a for a, b in zip(times, times[1:], strict=False))
    assert times[-1] == pytest.approx(4000 / 10.0)  # scaled like vLLM: last send at n / rate
    assert 2000 / times[1999] == pytest.approx(10.0, rel=0.1)  # the rate holds within the run too
    assert gap_cv(1.0) == pytest.approx(1.0, rel=0.15)  # exponential gaps


def test_burstiness_changes_the_variance():
    assert gap_cv(0.25) == pytest.approx(2.0, rel=0.15)  # gamma: CV = 1 / sqrt(shape)
    assert gap_cv(4.0) == pytest.approx(0.5, rel=0.15)
    assert gap_cv(math.inf) == pytest.approx(0.0, abs=1e-9)


def test_infinite_rate_and_bad_arguments():
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(0, 5.0) == []
    for rate, burstiness in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, burstiness)


@pytest.mark.parametrize("size", [1, 2, 3, 10, 101, 1000])
def test_percentile_is_numpys_linear_interpolation(size):
    values = np.random.default_rng(size).lognormal(size=size).tolist()
    for q in (0, 1, 25, 50, 90, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12)
    assert distribution(values).std == pytest.approx(np.std(values), rel=1e-9)


def test_percentile_edges():
    assert math.isnan(percentile([], 99))
    assert percentile([3.0], 99) == 3.0
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5  # unsorted input, between two ranks
    with pytest.raises(ValueError):
        percentile([1.0], 101)
