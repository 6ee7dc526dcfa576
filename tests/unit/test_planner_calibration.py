"""Calibration: fitting step times from a bench JSON recovers the coefficients that made it.

The bench JSON here is synthetic: the simulator, run with known step costs, writes it through
bench's own JSON writer, so the fit reads exactly the format `pdserve bench --output-json` has.
"""

import json
from dataclasses import replace

import pytest

from pdserve.bench.metrics import summarize
from pdserve.bench.report import write_json
from pdserve.costs.step_costs import StepCosts
from pdserve.planner.calibration import Calibration, FittedSteps, fit_steps, load_requests
from pdserve.planner.simulator import SimCluster, SimRequest, simulate
from tests.unit.calibrations import CALIBRATION

KNOWN = StepCosts(
    prefill_base_s=0.05, prefill_s_per_token=0.002, decode_base_s=0.03, decode_s_per_sequence=0.004
)


def _bench_json(path, requests, contention=0.0):
    cluster = SimCluster(
        prefill_replicas=1,
        decode_replicas=1,
        prefill_cost=KNOWN,
        decode_cost=KNOWN,
        kv_capacity_tokens=100_000,
        kv_bytes_per_token=1000,
        kv_bandwidth_bytes_per_s=1e8,
        kv_latency_s=0.01,
        workers_per_host=2,
        prefill_contention=contention,
        decode_contention=contention,
        route_policy="length",  # every prompt on the prefill worker, as the fit expects
        disaggregate_min_tokens=0,
    )
    records, duration = simulate(cluster, requests)
    write_json(path, {"workload": "synthetic (simulated)"}, summarize(records, duration), records)
    return path


def test_fit_recovers_known_step_costs_from_bench_json(tmp_path):
    # Run 1, one at a time: prompts of several lengths, each sent after the previous finished.
    lone = [SimRequest(3.0 * i, 100 + 150 * i, 4) for i in range(6)]
    # Run 2, a burst: eight requests at once with 10..80 output tokens, so the batch shrinks 8 → 1.
    burst = [SimRequest(0.0, 64, 10 * (i + 1)) for i in range(8)]
    paths = [_bench_json(tmp_path / "lone.json", lone), _bench_json(tmp_path / "burst.json", burst)]
    assert "requests" in json.loads(paths[0].read_text())

    fitted = fit_steps(load_requests(paths)).cost

    assert fitted.prefill_base_s == pytest.approx(KNOWN.prefill_base_s, rel=1e-6)
    assert fitted.prefill_s_per_token == pytest.approx(KNOWN.prefill_s_per_token, rel=1e-6)
    assert fitted.decode_base_s == pytest.approx(KNOWN.decode_base_s, rel=0.02)
    # The batch of a gap is counted at its midpoint from client-side times: close, not exact.
    assert fitted.decode_s_per_sequence == pytest.approx(KNOWN.decode_s_per_sequence, rel=0.03)


def test_fit_leaves_out_queued_and_batched_prefills_and_failed_requests():
    entry = dict(itl=[0.5, 0.1, 0.1], e2e=1.0, error=None)
    requests = [
        # a burst, sent at once: one prefill step for both, so neither TTFT is a lone prefill
        entry | dict(send_time=0.0, ttft=0.6, input_tokens=100),
        entry | dict(send_time=0.0, ttft=0.6, input_tokens=100),
        # queued behind the one before: neither is a lone prefill
        entry | dict(send_time=5.0, ttft=0.3, input_tokens=100),
        entry | dict(send_time=5.1, ttft=9.0, input_tokens=100),
        entry | dict(send_time=20.0, ttft=0.3, input_tokens=100),
        entry | dict(send_time=30.0, ttft=0.5, input_tokens=200),
        dict(send_time=40.0, ttft=None, itl=[], e2e=None, input_tokens=300, error="HTTP 500"),
    ]
    fitted = fit_steps([requests]).cost
    assert fitted.prefill_s_per_token == pytest.approx(0.002)
    assert fitted.prefill_base_s == pytest.approx(0.1)
    assert fitted.decode_base_s == pytest.approx(0.1)
    assert fitted.decode_s_per_sequence == pytest.approx(0.0, abs=1e-9)


def test_fit_without_samples_says_what_is_missing():
    with pytest.raises(ValueError, match="prefill"):
        fit_steps([[]])


def test_a_negative_slope_is_fitted_flat():
    entry = dict(itl=[], e2e=0.5, error=None)
    requests = [
        entry | dict(send_time=10.0 * i, ttft=1.0 - 0.001 * i, input_tokens=100 * i)
        for i in range(1, 4)
    ]
    with pytest.raises(ValueError, match="decode"):
        fit_steps([requests])  # no inter-token gaps at all
    requests[0]["itl"] = [0.3, 0.1, 0.1]
    fitted = fit_steps([requests]).cost
    assert fitted.prefill_s_per_token == 0.0 and fitted.prefill_base_s == pytest.approx(0.998)


@pytest.mark.parametrize("contention", [0.0, 0.6])
def test_fit_recovers_the_contention_of_a_shared_host(tmp_path, contention):
    lone = [SimRequest(3.0 * i, 100 + 150 * i, 4) for i in range(6)]
    burst = [SimRequest(0.0, 64, 10 * (i + 1)) for i in range(8)]
    # Prompts sent one at a time while six requests decode: both workers busy at once.
    overlap = [SimRequest(0.0, 64, 100) for _ in range(6)]
    overlap += [SimRequest(1.0 + 1.5 * i, 100 + 150 * i, 4) for i in range(4)]
    runs = [
        _bench_json(tmp_path / f"{name}.json", requests, contention)
        for name, requests in (("lone", lone), ("burst", burst), ("overlap", overlap))
    ]

    fitted = fit_steps(load_requests(runs))

    assert fitted.cost.prefill_s_per_token == pytest.approx(KNOWN.prefill_s_per_token, rel=1e-6)
    assert fitted.cost.decode_base_s == pytest.approx(KNOWN.decode_base_s, rel=0.03)
    assert fitted.prefill_contention == pytest.approx(contention, abs=0.02)
    assert fitted.decode_contention == pytest.approx(contention, abs=0.02)


def test_calibration_file_round_trips(tmp_path):
    path = tmp_path / "calibration.json"
    CALIBRATION.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "pdserve-calibration/2" and data["decode_contention"] == 0.7
    assert Calibration.load(path) == CALIBRATION
    assert CALIBRATION.cost == KNOWN
    assert CALIBRATION.alone_cost.prefill_s(1000) == pytest.approx(0.03 + 1.2)


def test_from_fit_without_a_lone_worker_gives_it_the_shared_costs():
    fitted = FittedSteps(KNOWN, 0.4, 0.7)
    rest = {"model": "m", "measured_on": "t", "workers_per_host": 1}
    calibration = Calibration.from_fit(fitted, kv_capacity_tokens=1, block_size=16, **rest)
    assert calibration.alone_cost == calibration.cost == KNOWN
    faster = FittedSteps(replace(KNOWN, prefill_s_per_token=0.001), 0.9, 0.9)
    calibration = Calibration.from_fit(fitted, faster, kv_capacity_tokens=1, block_size=16, **rest)
    assert calibration.alone_prefill_per_token_s == 0.001
    assert (calibration.prefill_contention, calibration.decode_contention) == (0.4, 0.7)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other"}, "not a calibration file"),
        ({"decode_base_s": "fast"}, "'decode_base_s' must be a number"),
        ({"workers_per_host": 1.5}, "'workers_per_host' must be an integer"),
        ({"prefill_contention": -0.1}, "must not be negative"),
        ({"block_size": 0}, "at least 1"),
    ],
)
def test_a_bad_calibration_file_is_refused_with_its_name(tmp_path, change, message):
    path = tmp_path / "calibration.json"
    CALIBRATION.save(path)
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=message) as error:
        Calibration.load(path)
    assert str(path) in str(error.value)


def test_a_negative_intercept_is_fitted_through_the_origin():
    # Convex prefill cost: a line through these TTFTs would cross zero above 0 tokens.
    entry = dict(itl=[0.3, 0.1, 0.1], e2e=1.0, error=None)
    requests = [
        entry | dict(send_time=10.0 * i, ttft=0.001 * n * n / 100, input_tokens=n)
        for i, n in enumerate((100, 200, 400))
    ]
    fitted = fit_steps([requests]).cost
    assert fitted.prefill_base_s == 0.0
    assert fitted.prefill_s_per_token == pytest.approx(
        sum(0.001 * n**3 / 100 for n in (100, 200, 400)) / sum(n * n for n in (100, 200, 400))
    )
