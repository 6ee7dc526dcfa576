"""Which data-parallel rank of a worker takes a request. A worker whose engine runs several
ranks (a node of a wide-EP group: pdserve/settings/engine.py) says how many in Health; each rank
has its own KV cache and batch, and vLLM runs a request on the rank it names. The router names
one, the rank with the fewest requests: what the worker's last Stats counted on each, plus what
this router sent each since. So a disaggregated request's KV goes to the rank that decodes it
(the prefill leg carries the rank: pdserve/protocol/data_parallel.py), and the ranks share the
load as the workers do."""

from pdserve.protocol import worker_pb2
from router.workers.handle import WorkerHandle


def pick_rank(worker: WorkerHandle) -> int:
    """The idlest of the worker's ranks (ties: the lowest), counted as sent to."""
    load = worker.load
    rank = min(range(max(1, worker.identity.data_parallel_ranks)), key=load.rank_requests)
    load.sent_to_rank(rank)
    return rank


def on_rank(
    worker: WorkerHandle, request: worker_pb2.GenerateRequest
) -> worker_pb2.GenerateRequest:
    """The request as `worker` takes it: a copy naming the rank `pick_rank` chose when the
    worker runs several, else the request itself (its engine has one rank)."""
    if worker.identity.data_parallel_ranks <= 1:
        return request
    addressed = worker_pb2.GenerateRequest()
    addressed.CopyFrom(request)
    addressed.data_parallel_rank = pick_rank(worker)
    return addressed
