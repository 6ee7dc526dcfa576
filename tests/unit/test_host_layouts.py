"""The host layouts `pdserve serve --layout auto` chooses among, simulated with a calibration."""

from dataclasses import replace

from pdserve.bench.metrics import Slo
from pdserve.planner.host_layouts import (
    HOST_WORKLOAD,
    HostLayout,
    host_hardware,
    host_layouts,
    layout_cluster,
    rank_host_layouts,
    ranking_table,
)
from pdserve.planner.search import Scenario
from tests.unit.calibrations import MODEST_LONE, TWO_CORES

TTFT_BOUND = Slo.parse("ttft=2s,tpot=150ms")
TPOT_BOUND = Slo.parse("ttft=1s,tpot=100ms")


def test_a_two_worker_host_has_three_layouts_and_their_serve_options():
    layouts = host_layouts(2)
    assert [layout.name for layout in layouts] == ["colocated", "1P1D", "2 x colocated"]
    assert [layout.serve_arguments for layout in layouts] == [
        ["--colocated", "--workers", "1"],
        ["--prefill", "1", "--decode", "1"],
        ["--colocated", "--workers", "2"],
    ]
    assert [layout.name for layout in host_layouts(1)] == ["colocated"]
    assert [layout.name for layout in host_layouts(3)][1:3] == ["1P2D", "2P1D"]


def test_a_lone_worker_runs_at_the_whole_hosts_costs_with_no_neighbour():
    hardware = host_hardware(TWO_CORES)
    alone = layout_cluster(HostLayout(0, 1, True), hardware)
    assert alone.decode_cost == TWO_CORES.alone_cost and alone.workers_per_host == 1
    split = layout_cluster(HostLayout(1, 1, False), hardware)
    assert split.prefill_cost == TWO_CORES.cost and split.workers_per_host == 2
    assert (split.prefill_replicas, split.decode_replicas) == (1, 1)


def test_the_ranking_follows_the_hosts_costs_and_the_slo():
    """A lone worker twice as fast as each of two serves the most under a TTFT-bound SLO. One
    only 1.4x faster at prefill loses to 1P1D under a TPOT-bound one: a long prompt's prefill
    stalls a colocated worker's decodes, while 1P1D's decode worker never prefills."""
    fast = rank_host_layouts(host_hardware(TWO_CORES), Scenario(HOST_WORKLOAD, TTFT_BOUND))
    modest = rank_host_layouts(host_hardware(MODEST_LONE), Scenario(HOST_WORKLOAD, TPOT_BOUND))
    assert (fast[0].layout.name, modest[0].layout.name) == ("colocated", "1P1D")
    for ranked in (fast, modest):
        goodputs = [row.evaluation.goodput for row in ranked]
        assert goodputs == sorted(goodputs, reverse=True) and goodputs[0] > 0
    assert ranking_table(modest).splitlines()[1].startswith("* 1P1D")


def test_at_a_fixed_rate_the_layouts_are_compared_there():
    hardware = host_hardware(TWO_CORES)
    ranked = rank_host_layouts(hardware, Scenario(HOST_WORKLOAD, TTFT_BOUND, num_requests=60), 0.5)
    assert {row.evaluation.rate for row in ranked} == {0.5}
    goodputs = [row.evaluation.goodput for row in ranked]
    assert goodputs == sorted(goodputs, reverse=True)


def test_without_a_lone_measurement_the_lone_worker_is_no_faster():
    slow = replace(
        TWO_CORES,
        alone_prefill_base_s=TWO_CORES.prefill_base_s,
        alone_prefill_per_token_s=TWO_CORES.prefill_per_token_s,
        alone_decode_base_s=TWO_CORES.decode_base_s,
        alone_decode_per_request_s=TWO_CORES.decode_per_request_s,
    )
    ranked = rank_host_layouts(host_hardware(slow), Scenario(HOST_WORKLOAD, TTFT_BOUND), 1.0)
    assert ranked[-1].layout.name == "colocated"
