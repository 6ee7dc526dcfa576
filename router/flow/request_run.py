"""One request's state while the router serves it: a run per prompt (a batch on /v1/completions
has several), the admitted request that holds them, and a run on its way. Times are the router's
monotonic seconds.

Each part of a run has one writer: admission makes it (its prompt, deadline, choices, a forced
path, its trace); the retry loop (router/flow/retries.py) sets the attempt that started and its
prefill leg; migration counts its moves; accounting (router/flow/accounting.py) its timings and
usage. The others only read.
"""

import time
from dataclasses import dataclass

from pdserve.core.kinds import RoutePath
from pdserve.costs.path_prices import RouteDecision
from pdserve.protocol import worker_pb2
from router.flow.disaggregation import PrefillOutcome
from router.flow.route_choice import Attempt
from router.http.errors import request_timeout
from router.http.responses import OutputOptions, Prompt
from router.workers.handle import WorkerHandle


@dataclass
class RequestRun:
    """One prompt's request, from admission to its last token."""

    # admission's
    request_id: str
    prompt_tokens: int
    arrival: float
    timeout_s: float = 600.0  # the request's one deadline is arrival + timeout_s, for every leg
    choices: int = 1  # sampled from the prompt (n, or best_of)
    route_forced: RouteDecision | None = None  # the client's x-pdserve-route, if it may set it
    trace: object = None  # the OpenTelemetry context of its span (pdserve/core/tracing.py)
    # the retry loop's: the attempt whose first chunk came, and its prefill leg
    attempt: Attempt | None = None
    prefill: PrefillOutcome | None = None  # when disaggregated
    # migration's: times the rest moved to another decode worker
    migrations: int = 0
    # accounting's
    first_token_at: float | None = None
    second_token_at: float | None = None  # disaggregated: the decode worker's first, usually
    last_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    last_chunk: worker_pb2.GenerateChunk | None = None  # the first worker's, first choice's

    @property
    def route(self) -> RoutePath:
        return self.attempt.route if self.attempt is not None else RoutePath.LOCAL

    @property
    def decision(self) -> RouteDecision | None:
        """Why the run took its path."""
        return self.attempt.decision if self.attempt is not None else None

    @property
    def decode_worker(self) -> WorkerHandle | None:
        """The worker its attempt sent the request (or its decode leg) to."""
        return self.attempt.decode if self.attempt is not None else None

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
