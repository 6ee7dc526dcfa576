"""A worker's load as the worker itself reports it (its Stats, polled by the router every
LOAD_POLL_S), plus what this router sent it since that report.

The report is the same for every router, so two routers rank the workers alike; the few
requests a router sent since the last report keep a burst between two polls from all landing
on the worker that looked idlest. `least-loaded` ranks by `busyness`; admission control sums
`capacity`.
"""

import time
from dataclasses import dataclass, field

from pdserve.core.kinds import Role
from pdserve.costs.path_prices import Arrivals
from pdserve.protocol import worker_pb2

LOAD_POLL_S = 0.5  # how often the router asks every live worker for its Stats
KV_FULL = 0.9  # share of KV blocks in use beyond which queued requests wait for blocks


@dataclass
class WorkerLoad:
    report: worker_pb2.StatsReply | None = None  # the worker's last Stats
    requests_since: int = 0  # requests this router sent it since that report
    prompt_tokens_since: int = 0  # their prompt tokens
    arrivals: Arrivals = field(default_factory=Arrivals)  # what this router sent, timed
    rank_sent: dict[int, int] = field(default_factory=dict)  # of them, to each DP rank

    def sent(self, prompt_tokens: int) -> None:
        self.requests_since += 1
        self.prompt_tokens_since += prompt_tokens
        self.arrivals.sent(time.monotonic(), prompt_tokens)

    def arrival_rates(self) -> tuple[float, float]:
        """Requests and prompt tokens per second this router sent the worker over the last
        RATE_WINDOW_S."""
        return self.arrivals.rates(time.monotonic())

    def sent_to_rank(self, rank: int) -> None:
        self.rank_sent[rank] = self.rank_sent.get(rank, 0) + 1

    def rank_requests(self, rank: int) -> int:
        """Requests on a data-parallel rank of the worker: its last report's, plus what this
        router sent that rank since."""
        running = self.report.data_parallel_running if self.report is not None else ()
        return (running[rank] if rank < len(running) else 0) + self.rank_sent.get(rank, 0)

    def reported(self, report: worker_pb2.StatsReply) -> None:
        self.report = report
        self.requests_since = self.prompt_tokens_since = 0
        self.rank_sent.clear()

    def busyness(self, role: str) -> tuple[float, ...]:
        """Smaller is idler. A prefill worker: prompt tokens it has yet to compute. A decode or
        colocated worker: requests in its engine, then the share of its KV blocks in use."""
        report = self.report or worker_pb2.StatsReply()
        if role == Role.PREFILL:
            return (report.outstanding_prefill_tokens + self.prompt_tokens_since,)
        used = report.kv_blocks_used / report.kv_blocks_total if report.kv_blocks_total else 0.0
        return (report.running_requests + self.requests_since, used)

    def full(self, max_num_seqs: int) -> bool:
        """Whether the worker already runs as many requests as it can (see `capacity`)."""
        running = (self.report.running_requests if self.report else 0) + self.requests_since
        return running >= self.capacity(max_num_seqs)

    def capacity(self, max_num_seqs: int) -> int:
        """Requests the worker can run at once: its engine's max_num_seqs, or, while its engine
        holds requests back for want of KV blocks (waiting ones with its blocks nearly all in
        use), only as many as it runs now."""
        report = self.report
        if (
            report is not None
            and report.waiting_requests
            and report.kv_blocks_total
            and report.kv_blocks_used >= KV_FULL * report.kv_blocks_total
        ):
            return max(1, min(max_num_seqs, report.running_requests - report.waiting_requests))
        return max_num_seqs
