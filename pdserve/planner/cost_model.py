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
from pdserve.planner.capacity import (
    DEFAULT_EP_BANDWIDTH,
    all_to_all_time,
    decode_step_lower_bound,
    prefill_time,
)
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
    search's preference for TP is optimistic where the interconnect is slow.

    A MoE model computes with its active parameters and reads the experts its tokens touch.
    With `expert_parallel` the group is one data-parallel rank of DP x TP GPUs sharing the
    routed experts: each step adds its tokens' all-to-all (dispatch and combine) over
    `all_to_all_bytes_per_s`, not overlapped with compute (DeepSeek's two micro-batches hide
    much of it: an upper bound)."""

    model: ModelSpec
    gpu: GpuSpec
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    all_to_all_bytes_per_s: float = DEFAULT_EP_BANDWIDTH

    @property
    def expert_parallel_size(self) -> int:
        return self.data_parallel_size * self.tensor_parallel_size if self.expert_parallel else 1

    def prefill_time(self, prompt_tokens: Sequence[int]) -> float:
        compute = sum(
            prefill_time(self.model, self.gpu, n, self.tensor_parallel_size) for n in prompt_tokens
        )
        return max(compute, self._memory_time([0])) + self._all_to_all(sum(prompt_tokens))

    def decode_time(self, context_tokens: Sequence[int]) -> float:
        # One new token per request: a multiply-add per active parameter (attention FLOPs are
        # small next to reading the KV cache, which the memory time counts).
        flops = 2 * self.model.active_params * len(context_tokens) / self.tensor_parallel_size
        compute = flops / (self.gpu.peak_flops * self.gpu.achievable_compute_fraction)
        memory = self._memory_time(context_tokens)
        return max(compute, memory) + self._all_to_all(len(context_tokens))

    def _memory_time(self, context_tokens: Sequence[int]) -> float:
        # The batch reads its KV tokens, as many requests each holding their mean.
        batch = max(1, len(context_tokens))
        return decode_step_lower_bound(
            self.model,
            self.gpu,
            batch,
            sum(context_tokens) / batch,
            self.tensor_parallel_size,
            self.expert_parallel_size,
        )

    def _all_to_all(self, tokens: int) -> float:
        return all_to_all_time(
            self.model, tokens, self.expert_parallel_size, self.all_to_all_bytes_per_s
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
