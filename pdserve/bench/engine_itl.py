"""The inter-token latency a system's engines themselves gave its tokens: vLLM's own histogram
`vllm:inter_token_latency_seconds`, whose every sample is the gap between two engine-core
timestamps of one request's outputs (vllm/v1/metrics/stats.py), summed over every engine the
system runs (plain vLLM's server, each pdserve worker). Beside the client's TPOT it says where a
gap between two systems is: in the engine's steps (the same engine, slowed by what else runs
on its cores) or in how the tokens travel to the client afterwards.

A prefill-only engine adds nothing to it (its requests have one token each).
"""

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAM = "vllm:inter_token_latency_seconds"


@dataclass(frozen=True)
class ItlTotals:
    """The histogram's sum (seconds) and count, over every engine, at one moment."""

    seconds: float
    tokens: float


def totals(metrics_urls: list[str], timeout_s: float = 10.0) -> ItlTotals:
    """Every engine's histogram, summed now."""
    seconds = tokens = 0.0
    for url in metrics_urls:
        text = httpx.get(url, timeout=timeout_s).raise_for_status().text
        for family in text_string_to_metric_families(text):
            if family.name != HISTOGRAM:
                continue
            for sample in family.samples:
                if sample.name == HISTOGRAM + "_sum":
                    seconds += sample.value
                elif sample.name == HISTOGRAM + "_count":
                    tokens += sample.value
    return ItlTotals(seconds, tokens)


def mean_between(before: ItlTotals, after: ItlTotals) -> float | None:
    """The mean engine inter-token latency (seconds) of the tokens made between the two
    readings; None if there were none."""
    tokens = after.tokens - before.tokens
    return (after.seconds - before.seconds) / tokens if tokens > 0 else None
