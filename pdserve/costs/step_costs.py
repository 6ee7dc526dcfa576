"""The one model of an engine step's time, in seconds:

    prefill step = prefill_base_s + prefill_s_per_token x prompt tokens it computes
    decode step  = decode_base_s + decode_s_per_sequence x sequences in the batch

A worker learns its figures from its own steps (pdserve/worker/step_costs.py) and reports them
in Stats; the router prices paths with them (pdserve/costs/path_prices.py); the planner
simulates a cluster with figures calibrated from a benchmark (pdserve/planner/calibration.py),
through the same two methods the roofline model has (`prefill_time`, `decode_time`)."""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    prefill_s_per_token: float
    decode_base_s: float
    decode_s_per_sequence: float
    prefill_base_s: float = 0.0  # the runtime learns none: its prefills share steps with decodes

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_s_per_token * tokens

    def decode_step_s(self, batch: int) -> float:
        return self.decode_base_s + self.decode_s_per_sequence * batch

    def prefill_time(self, prompt_tokens: Sequence[int]) -> float:
        """One step that computes these whole prompts together (the planner's StepCost)."""
        return self.prefill_s(sum(prompt_tokens))

    def decode_time(self, context_tokens: Sequence[int]) -> float:
        """One decode step over these requests; their context lengths are left out: on the
        contexts measured here their effect is lost in the noise."""
        return self.decode_step_s(len(context_tokens))


# SmolLM2-135M on one core of a 2-core CPU machine; the router replaces them by each worker's
# own figures as soon as it has run a prefill and a few decode steps.
DEFAULT_COSTS = StepCosts(
    prefill_s_per_token=0.003, decode_base_s=0.04, decode_s_per_sequence=0.004
)
