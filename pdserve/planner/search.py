"""The search behind `pdserve plan --gpus N`: every split of N GPUs into a prefill pool and a
decode pool (replicas and TP of each), and every set of colocated replicas (data parallel, each
worker prefilling its own prompts; TP of each), simulated, ranked by goodput per GPU.

Goodput per GPU is the figure to buy GPUs by: at a given request rate, the configuration that
meets the SLO with the fewest GPUs wins; without a rate, each configuration is pushed to the
highest rate at which it still meets the SLO for `attainment` of its requests (DistServe's
"per-GPU goodput"), and the configurations are compared there.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.bench.metrics import Slo, Summary, summarize
from pdserve.core.gpu_spec import GpuSpec
from pdserve.core.kinds import Role
from pdserve.planner.calibration import Calibration
from pdserve.planner.capacity import (
    DEFAULT_RESERVE_FRACTION,
    GIB,
    kv_bytes_per_token_per_gpu,
)
from pdserve.planner.cost_model import RooflineCost
from pdserve.planner.memory_fit import kv_cache_gib_that_fits
from pdserve.planner.model_spec import ModelSpec
from pdserve.planner.sim_workload import WorkloadSpec
from pdserve.planner.simulator import SimCluster, SimRequest, simulate


@dataclass(frozen=True)
class Candidate:
    """A configuration: no prefill replica means colocated (every decode replica prefills its
    own prompts, pdserve's local path; prefill_tp then equals decode_tp)."""

    prefill_replicas: int
    prefill_tp: int
    decode_replicas: int
    decode_tp: int

    @property
    def colocated(self) -> bool:
        return self.prefill_replicas == 0

    @property
    def gpus(self) -> int:
        return self.prefill_replicas * self.prefill_tp + self.decode_replicas * self.decode_tp

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated {self.decode_replicas}×TP{self.decode_tp}"
        return (
            f"{self.prefill_replicas}P×TP{self.prefill_tp} + "
            f"{self.decode_replicas}D×TP{self.decode_tp}"
        )


def head_splits(model: ModelSpec, gpus: int) -> list[int]:
    """TP sizes up to `gpus` that divide both the attention and the KV heads (attention is
    split by heads; an MLA model's one latent is kept whole by every rank)."""
    heads = model.num_attention_heads
    if model.mla is None:
        heads = math.gcd(heads, model.num_kv_heads)
    return [tp for tp in range(1, gpus + 1) if heads % tp == 0]


def candidates(tps: list[int], gpus: int) -> list[Candidate]:
    """Every configuration of these TP sizes that fits in `gpus`: colocated replicas, and
    splits with at least one replica per pool. The pools' TPs may differ: the KV transfer
    re-shards the heads (kv_transfer/head_shards.py)."""
    found = [Candidate(0, tp, replicas, tp) for tp in tps for replicas in range(1, gpus // tp + 1)]
    for prefill_tp in tps:
        for decode_tp in tps:
            for prefill in range(1, gpus // prefill_tp + 1):
                room = gpus - prefill * prefill_tp
                for decode in range(1, room // decode_tp + 1):
                    found.append(Candidate(prefill, prefill_tp, decode, decode_tp))
    return found


@dataclass(frozen=True)
class RooflineHardware:
    """Turns a candidate into a simulated cluster of `gpu`s running `model` at their roofline."""

    model: ModelSpec
    gpu: GpuSpec
    kv_bandwidth_bytes_per_s: float
    kv_latency_s: float
    reserve_fraction: float = DEFAULT_RESERVE_FRACTION

    def tensor_parallel_sizes(self, gpus: int) -> list[int]:
        return head_splits(self.model, gpus)

    def cluster(self, candidate: Candidate) -> SimCluster | None:
        """None when a pool's GPUs have not 1 GiB left for KV cache beside its share of the
        weights, the reserve and pdserve's KV buffers (pdserve/planner/memory_fit.py)."""
        prefill_gib = kv_cache_gib_that_fits(
            Role.PREFILL,
            self.model,
            self.gpu,
            candidate.prefill_tp,
            reserve_fraction=self.reserve_fraction,
        )
        decode_gib = kv_cache_gib_that_fits(
            Role.DECODE,
            self.model,
            self.gpu,
            candidate.decode_tp,
            reserve_fraction=self.reserve_fraction,
        )
        if (candidate.prefill_replicas and not prefill_gib) or not decode_gib:
            return None
        return SimCluster(
            prefill_replicas=candidate.prefill_replicas,
            decode_replicas=candidate.decode_replicas,
            prefill_cost=RooflineCost(self.model, self.gpu, candidate.prefill_tp),
            decode_cost=RooflineCost(self.model, self.gpu, candidate.decode_tp),
            kv_capacity_tokens=int(
                decode_gib * GIB // kv_bytes_per_token_per_gpu(self.model, candidate.decode_tp)
            ),
            # What moves per token: an MLA latent goes whole to each decode rank.
            kv_bytes_per_token=int(
                kv_bytes_per_token_per_gpu(self.model, candidate.decode_tp) * candidate.decode_tp
            ),
            kv_bandwidth_bytes_per_s=self.kv_bandwidth_bytes_per_s,
            kv_latency_s=self.kv_latency_s,
        )


@dataclass(frozen=True)
class CalibratedHardware:
    """Turns a candidate into a simulated cluster of workers as measured on a real one
    (planner.calibration): a GPU here is one worker of the calibrated size, and
    `workers_per_host` of them share a host, slowing each other down. Only TP 1: a measured
    worker says nothing about how its steps would split."""

    calibration: Calibration
    kv_bytes_per_token: int
    kv_bandwidth_bytes_per_s: float
    kv_latency_s: float

    def tensor_parallel_sizes(self, gpus: int) -> list[int]:
        return [1]

    def cluster(self, candidate: Candidate) -> SimCluster:
        calibration = self.calibration
        return SimCluster(
            prefill_replicas=candidate.prefill_replicas,
            decode_replicas=candidate.decode_replicas,
            prefill_cost=calibration.cost,
            decode_cost=calibration.cost,
            kv_capacity_tokens=calibration.kv_capacity_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_bandwidth_bytes_per_s=self.kv_bandwidth_bytes_per_s,
            kv_latency_s=self.kv_latency_s,
            block_size=calibration.block_size,
            workers_per_host=calibration.workers_per_host,
            prefill_contention=calibration.prefill_contention,
            decode_contention=calibration.decode_contention,
        )


SETTLE_E2ES = 4


@dataclass(frozen=True)
class Scenario:
    """The load every candidate is simulated under."""

    workload: WorkloadSpec
    slo: Slo
    num_requests: int = 200
    burstiness: float = 1.0
    seed: int = 0
    attainment: float = 0.9  # share of requests that must meet the SLO (without a fixed rate)

    def run(self, cluster: SimCluster, rate: float) -> Summary:
        """Simulate `num_requests`, or more at high rates: enough to keep arriving for
        `SETTLE_E2ES` times a lone request's E2E, so the batch reaches its steady size
        before the arrivals stop (a short burst would otherwise pass any SLO)."""
        lone = self.workload.requests(1, rate, seed=self.seed)
        _, lone_e2e = simulate(cluster, [replace(lone[0], arrival=0.0)])
        n = max(self.num_requests, math.ceil(rate * SETTLE_E2ES * lone_e2e))
        records, duration = simulate(
            cluster, self.workload.requests(n, rate, self.burstiness, self.seed)
        )
        return summarize(records, duration, self.slo)

    def meets(self, summary: Summary) -> bool:
        return summary.slo_attainment >= self.attainment

    def highest_rate(self, cluster: SimCluster, steps: int = 5) -> tuple[float, Summary]:
        """The highest rate, up to the cluster's throughput bound, whose run meets the
        attainment, with that run: halving from the bound until a run passes, then bisecting
        `steps` times. Rate 0 (and the last failing run) when not even a near-idle cluster
        passes. The bound caps the search because a finite run past it can still look good:
        its queues only grow for as long as requests keep coming."""
        rate = throughput_bound(
            cluster, self.workload.requests(self.num_requests, 1.0, seed=self.seed)
        )
        failing = None
        for _ in range(20):
            summary = self.run(cluster, rate)
            if self.meets(summary):
                break
            failing, rate = rate, rate / 2
        else:
            return 0.0, summary
        passing = (rate, summary)
        for _ in range(steps if failing is not None else 0):
            middle = (passing[0] + failing) / 2
            summary = self.run(cluster, middle)
            if self.meets(summary):
                passing = (middle, summary)
            else:
                failing = middle
        return passing


def throughput_bound(cluster: SimCluster, requests: list[SimRequest]) -> float:
    """Requests/s the pools can sustain at all, with full steps, no SLO and no contention, for
    requests of these mean lengths: the smaller of what the prefill pool computes and what the
    decode pool generates at its largest batch (by max_decode_batch or by KV capacity); for
    colocated replicas, what they do when each request costs its prefill and its share of the
    decode steps."""
    prompt = round(sum(r.prompt_tokens for r in requests) / len(requests))
    output = sum(r.output_tokens for r in requests) / len(requests)
    batch = max(
        1, min(cluster.max_decode_batch, cluster.kv_capacity_tokens // round(prompt + output))
    )
    step = cluster.decode_cost.decode_time([round(prompt + output / 2)] * batch)
    decoding = step * max(1.0, output - 1) / batch  # per request; token 1 is the prefill's
    if cluster.prefill_replicas == 0:
        return cluster.decode_replicas / (cluster.decode_cost.prefill_time([prompt]) + decoding)
    per_step = max(1, cluster.prefill_token_budget // prompt)
    prefill = (
        cluster.prefill_replicas * per_step / cluster.prefill_cost.prefill_time([prompt] * per_step)
    )
    return min(prefill, cluster.decode_replicas / decoding)


@dataclass(frozen=True)
class Evaluation:
    candidate: Candidate
    rate: float  # the offered rate it was simulated at
    summary: Summary
    meets_slo: bool  # whether the run met the scenario's attainment

    @property
    def goodput(self) -> float:
        """Steady-state goodput: offered rate × share of requests meeting the SLO. Bench's
        good requests / duration tends to it on long runs; on a short simulated run at a high
        rate the drain after the last arrival would otherwise weigh more than the load."""
        return self.rate * self.summary.slo_attainment

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.candidate.gpus


def search(
    hardware: RooflineHardware | CalibratedHardware,
    scenario: Scenario,
    gpus: int,
    rate: float | None = None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> list[Evaluation]:
    """Every candidate that fits, best first: those that meet the attainment before those that
    do not (at a fixed rate, one GPU at half the attainment would otherwise beat two that meet
    it), then highest goodput per GPU, then fewer GPUs."""
    found = candidates(hardware.tensor_parallel_sizes(gpus), gpus)
    evaluations = []
    for done, candidate in enumerate(found, start=1):
        cluster = hardware.cluster(candidate)
        if cluster is not None:
            run_rate, summary = (
                (rate, scenario.run(cluster, rate))
                if rate is not None
                else scenario.highest_rate(cluster)
            )
            meets = run_rate > 0 and scenario.meets(summary)
            evaluations.append(Evaluation(candidate, run_rate, summary, meets))
        progress(done, len(found))
    return sorted(
        evaluations,
        key=lambda e: (not e.meets_slo, -e.goodput_per_gpu, e.candidate.gpus, e.candidate.label),
    )
