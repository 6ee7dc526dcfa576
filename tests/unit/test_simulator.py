"""The discrete-event simulator: hand-computed timings, KV capacity, the local path, and the
sanity checks of issue 5 (collapse past capacity; the bottleneck pool is the one that helps)."""

from dataclasses import replace

import pytest

from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.workload import Length
from pdserve.core.gpu_spec import GPU_PRESETS
from pdserve.costs.step_costs import StepCosts
from pdserve.planner.cost_model import RooflineCost
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.planner.sim_workload import WorkloadSpec
from pdserve.planner.simulator import SimCluster, SimRequest, simulate

ROUTER_FIELDS = ("route_policy", "disaggregate_min_tokens")

# prefill = 0.1 + 0.001/token; decode = 0.02 + 0.01/request in the batch
COST = StepCosts(
    prefill_base_s=0.1, prefill_s_per_token=0.001, decode_base_s=0.02, decode_s_per_sequence=0.01
)


def cluster(prefill=1, decode=1, cost=COST, **overrides) -> SimCluster:
    settings = dict(
        prefill_replicas=prefill,
        decode_replicas=decode,
        prefill_cost=cost,
        decode_cost=cost,
        kv_capacity_tokens=100_000,
        kv_bytes_per_token=1000,
        kv_bandwidth_bytes_per_s=1e8,
        kv_latency_s=0.005,
        block_size=16,
        # Every prompt disaggregated, so the hand-computed timings follow one path; the
        # router's own choice has tests of its own below.
        route_policy="length",
        disaggregate_min_tokens=0,
    )
    return SimCluster(**settings | overrides)


def test_one_request_hand_computed():
    records, duration = simulate(
        cluster(), [SimRequest(arrival=1.0, prompt_tokens=100, output_tokens=3)]
    )
    (record,) = records
    prefill = 0.1 + 0.001 * 100
    transfer = 0.005 + 100 * 1000 / 1e8
    step = 0.02 + 0.01 * 1
    assert record.ok and record.output_tokens == 3
    assert record.ttft == pytest.approx(prefill)
    assert record.itl == pytest.approx([transfer + step, step])
    assert record.e2e == pytest.approx(prefill + transfer + 2 * step)
    assert duration == pytest.approx(1.0 + record.e2e)
    assert record.tpot == pytest.approx((transfer + 2 * step) / 2)


def test_prefill_batches_queued_prompts_up_to_the_token_budget():
    # The first prompt starts alone; the next three queue behind it, two fit in the next step.
    requests = [SimRequest(0.0, 100, 1) for _ in range(4)]
    records, _ = simulate(cluster(prefill_token_budget=200), requests)
    one, two = 0.1 + 0.001 * 100, 0.1 + 0.001 * 200
    assert [r.ttft for r in records] == pytest.approx([one, one + two, one + two, one + two + one])


def test_requests_wait_for_kv_blocks_when_the_decode_cache_is_full():
    # Room for one request's context (7 blocks of 16 tokens) at a time.
    requests = [SimRequest(0.0, 100, 10), SimRequest(0.0, 100, 10)]
    full, _ = simulate(cluster(kv_capacity_tokens=7 * 16), requests)
    roomy, _ = simulate(cluster(), requests)
    first_done = full[0].e2e
    # The second request's KV arrives early but its second token comes only after the first
    # finished.
    assert full[1].ttft + full[1].itl[0] > first_done
    assert roomy[1].ttft + roomy[1].itl[0] < roomy[0].e2e


def test_a_request_larger_than_the_kv_cache_fails_and_counts_against_goodput():
    requests = [SimRequest(0.0, 100, 10), SimRequest(0.1, 10_000, 10)]
    records, duration = simulate(cluster(kv_capacity_tokens=1000), requests)
    assert records[0].ok and not records[1].ok and "KV cache" in records[1].error
    summary = summarize(records, duration, Slo(ttft=10))
    assert summary.failed == 1 and summary.slo_attainment == 0.5


def test_short_prompts_take_the_local_path_on_the_decode_worker():
    records, _ = simulate(cluster(disaggregate_min_tokens=256), [SimRequest(0.0, 100, 3)])
    step = 0.02 + 0.01
    assert records[0].ttft == pytest.approx(0.1 + 0.001 * 100)  # prefilled by the decode worker
    assert records[0].itl == pytest.approx([step, step])  # no KV transfer
    records, _ = simulate(cluster(prefill=0), [SimRequest(0.0, 1000, 2)])
    assert records[0].ttft == pytest.approx(0.1 + 1.0)


def test_by_default_it_chooses_paths_as_the_router_does():
    """The default cluster models the router's defaults (--route-policy estimate, floor 256)
    with the router's own function: a short prompt stays local; a long one beside requests the
    decode worker is decoding goes to the idle prefill worker (its prefill would stall them); and a
    burst of long prompts is shared between the two workers instead of queueing on one."""
    default = replace(cluster(), route_policy="estimate", disaggregate_min_tokens=256)
    assert default == replace(cluster(), **{f: getattr(SimCluster, f) for f in ROUTER_FIELDS})
    records, _ = simulate(default, [SimRequest(0.0, 100, 3)])
    assert records[0].ttft == pytest.approx(0.1 + 0.001 * 100)  # the decode worker prefilled it
    decoding = [SimRequest(0.0, 100, 200) for _ in range(4)]
    records, _ = simulate(default, [*decoding, SimRequest(1.0, 2000, 3)])
    transfer = 0.005 + 2000 * 1000 / 1e8
    assert records[-1].itl[0] > transfer  # its KV travelled from the prefill worker
    assert all(record.itl[-1] < 0.1 for record in records[:4])  # and the decodes did not stall
    backed_up = [SimRequest(0.0, 8000, 3) for _ in range(4)] + [SimRequest(0.01, 2000, 3)]
    estimated, _ = simulate(default, backed_up)
    by_length, _ = simulate(replace(default, route_policy="length"), backed_up)
    long_prefill = 0.1 + 0.001 * 8000
    # The first two computed side by side, one on each worker; by length, one after the other.
    assert [r.ttft for r in estimated[:2]] == pytest.approx([long_prefill] * 2)
    assert [r.ttft for r in by_length[:2]] == pytest.approx([long_prefill, 2 * long_prefill])
    assert by_length[-1].ttft > 4 * (0.1 + 0.001 * 8000)  # queued behind the four long prompts
    assert estimated[-1].ttft < 0.6 * by_length[-1].ttft


def test_same_requests_same_result():
    requests = WorkloadSpec(Length.parse("50-500"), Length.parse("1-50")).requests(100, 5.0, seed=3)
    first, second = simulate(cluster(), requests), simulate(cluster(), requests)
    assert first == second
    assert requests != WorkloadSpec(Length.parse("50-500"), Length.parse("1-50")).requests(
        100, 5.0, seed=4
    )


def _attainment(sim_cluster: SimCluster, workload: WorkloadSpec, rate: float, slo: Slo) -> float:
    records, duration = simulate(sim_cluster, workload.requests(200, rate, seed=0))
    return summarize(records, duration, slo).slo_attainment


def test_goodput_collapses_past_capacity():
    # One prefill worker does ~1/(0.1 + 0.001·200 / batch) ≥ 3 prompts/s; far beyond, queues grow.
    workload = WorkloadSpec(Length.parse("200"), Length.parse("8"))
    slo = Slo(ttft=1.0, tpot=0.2)
    below, past = (
        _attainment(cluster(), workload, 1.0, slo),
        _attainment(cluster(), workload, 40.0, slo),
    )
    assert below > 0.95
    assert past < 0.3


def test_more_decode_workers_help_a_decode_bound_workload():
    # A decode worker makes at most 1/0.001 = 1000 tokens/s, 5 requests/s of 200 tokens.
    cost = StepCosts(
        prefill_base_s=0.01,
        prefill_s_per_token=0.0001,
        decode_base_s=0.02,
        decode_s_per_sequence=0.001,
    )
    workload = WorkloadSpec(Length.parse("16"), Length.parse("200"))
    slo = Slo(ttft=1.0, tpot=0.1)
    one, three = (_attainment(cluster(decode=d, cost=cost), workload, 6.0, slo) for d in (1, 3))
    assert one < 0.5 < 0.9 < three


def test_more_prefill_workers_help_a_prefill_bound_workload():
    workload = WorkloadSpec(Length.parse("1500"), Length.parse("4"))
    slo = Slo(ttft=5.0, tpot=0.1)
    one, three = (_attainment(cluster(prefill=p), workload, 1.0, slo) for p in (1, 3))
    assert one < 0.5 < 0.9 < three


def test_roofline_cost_is_bandwidth_bound_in_decode_and_compute_bound_in_prefill():
    model, gpu = MODEL_PRESETS["llama-7b"], GPU_PRESETS["A100-80GB"]
    cost = RooflineCost(model, gpu)
    assert cost.decode_time([0]) == pytest.approx(14e9 / 2039e9)  # weights only: the seed's 6.9 ms
    assert cost.decode_time([1000] * 8) == pytest.approx((14e9 + 8000 * 524288) / 2039e9)
    assert cost.prefill_time([4096]) > cost.prefill_time([1024]) * 4  # attention is quadratic
    assert RooflineCost(model, gpu, 2).decode_time([1000]) == pytest.approx(
        cost.decode_time([1000]) / 2
    )


def test_workers_sharing_a_host_slow_each_other_while_both_are_busy():
    # Every step takes 1 s alone. A: prefill [0, 1], then decode steps from 1. B arrives at 1.5:
    # its prefill and A's decode share the host, each at pace 1 / (1 + 0.5) while both run.
    # A's step 1 has 0.5 s left at 1.5 → ends 2.25; B's prefill has done 0.5 by then and shares
    # the host with A's step 2 until it ends at 3.0; A's step 2 then runs alone: 0.5 s left → 3.5.
    flat = StepCosts(
        prefill_s_per_token=0.0, decode_base_s=1.0, decode_s_per_sequence=0.0, prefill_base_s=1.0
    )
    requests = [SimRequest(0.0, 100, 3), SimRequest(1.5, 100, 1)]
    shared = cluster(cost=flat, kv_latency_s=0.0, kv_bandwidth_bytes_per_s=1e15)
    alone, _ = simulate(shared, requests)
    assert alone[0].itl == pytest.approx([1.0, 1.0]) and alone[1].ttft == pytest.approx(1.0)
    contended = replace(shared, workers_per_host=2, prefill_contention=0.5, decode_contention=0.5)
    a, b = simulate(contended, requests)[0]
    assert a.ttft == pytest.approx(1.0) and a.itl == pytest.approx([1.25, 1.25])
    assert b.ttft == pytest.approx(1.5)
    # Workers on hosts of their own: no contention whatever the factor.
    apart = replace(contended, workers_per_host=1)
    assert [r.itl for r in simulate(apart, requests)[0]] == [r.itl for r in alone]
