"""Open-loop arrival schedules: when each request is sent, as offsets from the benchmark start.

Same process as `vllm bench serve` (`get_request`): inter-arrival gaps are gamma distributed
with shape = burstiness and mean 1/rate, so burstiness 1.0 is a Poisson process, below 1 is
burstier and above 1 more regular (infinite burstiness: fixed gaps). Like vLLM, the schedule is
then scaled so the last request goes out at exactly n / rate, which keeps the offered load
identical across seeds. An infinite rate sends everything at once. The random stream is numpy's
`default_rng(seed)`, so a seed gives the same schedule here every time, not vLLM's schedule.
"""

import math

import numpy as np


def arrival_times(
    n: int, rate: float, burstiness: float = 1.0, seed: int | None = None
) -> list[float]:
    """Send offsets in seconds (non-decreasing) for `n` requests at `rate` requests/s."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = np.random.default_rng(seed).gamma(
            shape=burstiness, scale=1.0 / (rate * burstiness), size=n
        )
    times = np.cumsum(gaps)
    return (times * (n / rate) / times[-1]).tolist()
