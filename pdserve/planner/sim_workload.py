"""Simulated request streams, drawn the way `pdserve bench` draws its own.

Lengths use bench's distributions (`Length`: N, LOW-HIGH, normal:MEAN,STD) and arrivals use
bench's arrival process with the same seed, so a prediction can be run on the very schedule a
benchmark will send (see `from_bench`).
"""

from dataclasses import dataclass

import numpy as np

from pdserve.bench.arrivals import arrival_times
from pdserve.bench.workload import BenchRequest, Length
from pdserve.planner.simulator import SimRequest


@dataclass(frozen=True)
class WorkloadSpec:
    """Prompt and output lengths; with `long_fraction` > 0, that share of the prompts draw
    from `long_input_len` instead (bench's `mixed` workload)."""

    input_len: Length
    output_len: Length
    long_fraction: float = 0.0
    long_input_len: Length | None = None

    def requests(
        self, n: int, rate: float, burstiness: float = 1.0, seed: int = 0
    ) -> list[SimRequest]:
        """`n` requests arriving at `rate` req/s; the same seed gives the same lengths at any
        rate, so rates compare like for like."""
        rng = np.random.default_rng(seed)
        prompts = self.input_len.sample(rng, n)
        if self.long_fraction > 0:
            longs = self.long_input_len.sample(rng, n)
            for i in rng.choice(n, size=round(self.long_fraction * n), replace=False):
                prompts[i] = longs[i]
        outputs = self.output_len.sample(rng, n)
        arrivals = arrival_times(n, rate, burstiness, seed)
        return [SimRequest(t, p, o) for t, p, o in zip(arrivals, prompts, outputs, strict=True)]


def from_bench(requests: list[BenchRequest], offsets: list[float]) -> list[SimRequest]:
    """The simulated twin of a benchmark's requests and send offsets."""
    return [
        SimRequest(offset, r.prompt_tokens, r.max_tokens)
        for r, offset in zip(requests, offsets, strict=True)
    ]
