"""One request's state while the router serves it, shared by the flow's steps: a run per prompt
(a batch on /v1/completions has several), the admitted request that holds them, and a run on
its way. Times are the router's monotonic seconds."""

import time
from dataclasses import dataclass, field

from pdserve.core.kinds import RoutePath
from pdserve.costs.path_prices import RouteDecision
from pdserve.protocol import worker_pb2
from router.flow.disaggregation import PrefillOutcome
from router.http.errors import request_timeout
from router.http.responses import OutputOptions, Prompt
from router.workers.client import WorkerClient


@dataclass
class RequestRun:
    """One prompt's request, from admission to its last token."""

    request_id: str
    prompt_tokens: int
    arrival: float
    timeout_s: float = 600.0  # the request's one deadline is arrival + timeout_s, for every leg
    route: RoutePath = RoutePath.LOCAL
    # A path fixed before any estimate, and why: the client's x-pdserve-route ("header"), or
    # local once every prefill worker was lost ("prefill_lost").
    route_forced: RouteDecision | None = None
    decision: RouteDecision | None = None  # why the run took its path
    prefill: PrefillOutcome | None = None  # the prefill leg, when disaggregated
    decode_worker: WorkerClient | None = None
    # disaggregated: leading prompt tokens the router expects the decode worker to hold already,
    # estimated before the run's first attempt on it (which then counts as sent there)
    decode_holds: dict[str, int] = field(default_factory=dict)  # worker address -> tokens
    first_token_at: float | None = None
    second_token_at: float | None = None  # disaggregated: the decode worker's first, usually
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_chunk: worker_pb2.GenerateChunk | None = None
    migrations: int = 0
    choices: int = 1  # sampled from the prompt (n, or best_of)
    # The OpenTelemetry context of the request's span (pdserve/core/tracing.py).
    trace: object = None

    def time_left(self) -> float:
        """Seconds until the request's deadline; a 504 once it has passed."""
        left = self.arrival + self.timeout_s - time.monotonic()
        if left <= 0:
            raise request_timeout(self.timeout_s)
        return left


@dataclass
class Admitted:
    """A request that passed validation, ready to start: one run per prompt, each with its
    worker request."""

    request_id: str
    runs: list[RequestRun]
    worker_requests: list[worker_pb2.GenerateRequest]
    prompts: list[Prompt]
    options: OutputOptions
    stream: bool
    include_usage: bool
    returned: int = 1  # choices returned per prompt (n): the best of `run.choices`
    priority: int = 0  # its class in the router's queue (router/flow/admission_gate.py)


@dataclass
class Started:
    """A run on its way: its first chunk, the rest, and the response headers."""

    first: worker_pb2.GenerateChunk
    chunks: object  # async iterator of the rest
    headers: dict
