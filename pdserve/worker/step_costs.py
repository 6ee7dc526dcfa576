"""What a step of this worker's engine costs (pdserve/costs/step_costs.py's model), learned online
from vLLM's iteration stats and reported in Stats, so that the router can price each path
(pdserve/costs/path_prices.py).

- prefill: seconds per computed prompt token, from each finished request's prefill time (its
  first schedule to its first token) over the prompt tokens it computed (cache and transferred
  KV hits excluded); requests that computed fewer than MIN_PREFILL_TOKENS are left out, since
  one decode step dominates their time. The figure is a low quantile (PREFILL_QUANTILE) of the
  last PREFILL_SAMPLES: a prompt computed beside others, or between decode steps, takes longer
  than its own cost, and the router counts those others itself (queued tokens, decoding
  requests), so the mean would count them twice;
- decode: a step's seconds as base + per_sequence x batch, fitted by least squares over the
  recent pure decode steps (steps that finished no prefill), older steps fading by DECAY.
Until a worker has run at two batch sizes the slope is unknown, and one more sequence is taken
to cost DEFAULT_SEQUENCE_SHARE of a step.
"""

from collections import deque

from pdserve.costs.step_costs import StepCosts

MIN_PREFILL_TOKENS = 32
PREFILL_SAMPLES = 32
PREFILL_QUANTILE = 0.25
DECAY = 0.98  # weight left to every older decode step at each new one
MIN_BATCH_SPREAD = 0.25  # variance of the batch sizes seen below which the slope is unknown
DEFAULT_SEQUENCE_SHARE = 0.1
MAX_STEP_S = 5.0  # a longer gap between two tokens is an idle engine, not a step


class StepCostLearner:
    def __init__(self) -> None:
        self._prefill_samples: deque[float] = deque(maxlen=PREFILL_SAMPLES)
        self._weight = self._batch = self._step = self._batch_sq = self._batch_step = 0.0

    def finished_request(self, prefill_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        computed = prompt_tokens - cached_tokens
        if computed < MIN_PREFILL_TOKENS or prefill_s <= 0:
            return
        self._prefill_samples.append(prefill_s / computed)

    @property
    def prefill_s_per_token(self) -> float:
        """0 until a request computed MIN_PREFILL_TOKENS prompt tokens."""
        if not self._prefill_samples:
            return 0.0
        ordered = sorted(self._prefill_samples)
        return ordered[int(PREFILL_QUANTILE * (len(ordered) - 1))]

    def decode_step(self, batch: int, step_s: float) -> None:
        """One pure decode step: `batch` sequences each got a token `step_s` after their last."""
        if batch < 1 or not 0 < step_s < MAX_STEP_S:
            return
        self._weight = self._weight * DECAY + 1
        self._batch = self._batch * DECAY + batch
        self._step = self._step * DECAY + step_s
        self._batch_sq = self._batch_sq * DECAY + batch * batch
        self._batch_step = self._batch_step * DECAY + batch * step_s

    def costs(self) -> StepCosts:
        """What it learned so far: zeros for what it has not seen yet (no prefill of
        MIN_PREFILL_TOKENS, no decode step)."""
        base, slope = self._decode_fit()
        return StepCosts(
            prefill_s_per_token=self.prefill_s_per_token,
            decode_base_s=base,
            decode_s_per_sequence=slope,
        )

    def _decode_fit(self) -> tuple[float, float]:
        """step(batch) = base + per_sequence x batch, as (base, per_sequence)."""
        if self._weight == 0:
            return 0.0, 0.0
        mean_batch = self._batch / self._weight
        mean_step = self._step / self._weight
        variance = self._batch_sq / self._weight - mean_batch**2
        if variance >= MIN_BATCH_SPREAD:
            slope = (self._batch_step / self._weight - mean_batch * mean_step) / variance
            slope = max(slope, 0.0)
        else:
            slope = DEFAULT_SEQUENCE_SHARE * mean_step
        return max(mean_step - slope * mean_batch, 0.0), slope

    def record_iteration(self, iteration_stats) -> None:
        """vLLM's IterationStats of one engine step: a pure decode step's time and batch."""
        latencies = iteration_stats.inter_token_latencies_iter
        if latencies and not iteration_stats.time_to_first_tokens_iter:
            self.decode_step(len(latencies), sum(latencies) / len(latencies))
        for finished in iteration_stats.finished_requests:
            self.finished_request(
                finished.prefill_time, finished.num_prompt_tokens, finished.num_cached_tokens
            )
