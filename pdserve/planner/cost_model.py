"""Per-step cost models for the simulator: how long one engine step of a worker takes.

The simulator only asks two questions of a worker: how long a prefill step over some prompts
takes, and how long a decode step over a batch of requests (given their context lengths) takes.
Two answers are kept side by side so a plan can be made before any hardware exists (roofline,
from the capacity math) and checked against the real engine afterwards: calibrated, fitted from
a benchmark by pdserve.planner.calibration into the StepCosts model the workers learn and the
router prices with (pdserve/costs/step_costs.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.core.gpu_spec import GpuSpec
from pdserve.costs.step_costs import StepCosts
from pdserve.planner.capacity import decode_step_lower_bound, prefill_time
from pdserve.planner.model_spec import ModelSpec


class StepCost(Protocol):
    def prefill_time(self, prompt_tokens: Sequence[int]) -> float:
        """Seconds for one step that computes these whole prompts together."""
        ...

    def decode_time(self, context_tokens: Sequence[int]) -> float:
        """Seconds for one decode step over a batch whose requests hold these contexts."""
        ...


@dataclass(frozen=True)
class RooflineCost:
    """A TP group of GPUs running at its roofline: a step takes the longer of its memory time
    (weights once, plus the batch's KV cache, at full bandwidth) and its compute time (FLOPs at
    the GPU's achievable share of peak). TP is taken as ideal (no all-reduce cost), so the
    search's preference for TP is optimistic where the interconnect is slow."""

    model: ModelSpec
    gpu: GpuSpec
    tensor_parallel_size: int = 1

    def prefill_time(self, prompt_tokens: Sequence[int]) -> float:
        compute = sum(
            prefill_time(self.model, self.gpu, n, self.tensor_parallel_size) for n in prompt_tokens
        )
        return max(compute, self._memory_time(0))

    def decode_time(self, context_tokens: Sequence[int]) -> float:
        # One new token per request: a multiply-add per parameter (attention FLOPs are small
        # next to reading the KV cache, which the memory time counts).
        flops = 2 * self.model.num_params * len(context_tokens) / self.tensor_parallel_size
        compute = flops / (self.gpu.peak_flops * self.gpu.achievable_compute_fraction)
        return max(compute, self._memory_time(sum(context_tokens)))

    def _memory_time(self, kv_tokens: int) -> float:
        # The capacity bound for one request holding every KV token of the batch reads the same
        # bytes as the batch does.
        return decode_step_lower_bound(
            self.model, self.gpu, 1, kv_tokens, self.tensor_parallel_size
        )


LINEARIZED_AT_TOKENS = 1024  # the prompt and context length a roofline is read at, to linearize


def linearized(cost: StepCost) -> StepCosts:
    """`cost` as the StepCosts line the router prices with: a calibrated model is one already; a
    roofline is read at LINEARIZED_AT_TOKENS (one prompt of that length; a batch of one and of
    two requests holding that context)."""
    if isinstance(cost, StepCosts):
        return cost
    n = LINEARIZED_AT_TOKENS
    one, two = cost.decode_time([n]), cost.decode_time([n, n])
    return StepCosts(
        prefill_s_per_token=cost.prefill_time([n]) / n,
        decode_base_s=max(0.0, 2 * one - two),
        decode_s_per_sequence=max(0.0, two - one),
    )
