"""How long a request would wait before its prompt starts computing, predicted at its arrival,
so that admission can refuse at once (429) a request that would wait past its limit instead of
holding its client until the queue timeout.

A request waits twice: in the router's queue for a turn (router/flow/admission_gate.py counts the
turns ahead of it and learns how long a turn is held), then on its worker behind the prompts
already sent there. This module prices what the gate cannot see, from the figures the route
estimate uses (router/flow/route_choice.py: each worker's last Stats, what this router sent it
since, the step costs it learned):

- `hold_s`: how long a request holds its turn (its prefill, then its expected output at the
  decode step its worker runs), the gate's figure until it has seen turns given back;
- `backlog_s`: the prompt work queued ahead of a new prompt on the least busy worker that could
  compute it, counting the prompts the gate let through that no worker has reported yet (a
  burst is let through within one poll of the workers' Stats).
"""

import math
from dataclasses import dataclass

from pdserve.core.kinds import Role
from pdserve.costs.path_prices import MAX_EXPECTED_OUTPUT_TOKENS
from pdserve.costs.step_costs import StepCosts
from router.flow.route_choice import cluster_costs, worker_state
from router.workers.pool import TAKES_REQUESTS, WorkerPool

PROMPT_ROLES = (*TAKES_REQUESTS, Role.PREFILL)  # the workers that may compute a prompt


@dataclass(frozen=True)
class Ask:
    """What the gate knows of a request asking for a turn."""

    prompt_tokens: int = 0  # of all its prompts
    max_tokens: int = 1  # per prompt
    priority: int = 0  # its class: smaller is served first and shed last (vLLM's convention)
    give_up_at: float = math.inf  # monotonic: the latest its prompt may start computing


class WaitForecast:
    """The workers' side of a request's wait, priced from the pool's live state."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def costs(self) -> StepCosts:
        return cluster_costs(self.pool.live(PROMPT_ROLES))

    def hold_s(self, ask: Ask, batch: int) -> float:
        """Seconds a request like `ask` holds its turn, its worker decoding `batch` at once."""
        costs = self.costs()
        steps = max(0, min(ask.max_tokens, MAX_EXPECTED_OUTPUT_TOKENS) - 1)
        return costs.prefill_s(ask.prompt_tokens) + steps * costs.decode_step_s(max(1, batch))

    def backlog_s(self, unreported_tokens: int) -> float:
        """Seconds of prompt work ahead of a new prompt: the least any worker that could compute
        it has queued (its Stats plus what this router sent it since), or `unreported_tokens`
        (prompts let through, not yet started) spread over those workers, whichever is more."""
        workers = self.pool.live(PROMPT_ROLES)
        if not workers:
            return 0.0
        cluster = self.costs()
        queued = []
        for worker in workers:
            state = worker_state(worker, cluster)
            queued.append(state.costs.prefill_s(state.queued_tokens))
        return max(min(queued), cluster.prefill_s(unreported_tokens) / len(workers))
