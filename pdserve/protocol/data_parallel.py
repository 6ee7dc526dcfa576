"""Where a data-parallel worker's ranks receive KV: what the router (which names the rank), the
prefill worker (which sends to it) and the decode worker (whose ranks listen) agree on.

A worker whose engine runs several data-parallel ranks (a wide-EP group's node) has, per rank,
`tensor_parallel_size` KV receivers: rank d's tensor-parallel rank r listens on the worker's KV
port + d x TP + r. vLLM's NixlConnector addresses a DP rank alike (its side channel's port + the
DP index)."""


def kv_rank_offset(data_parallel_rank: int, tensor_parallel_size: int, tensor_rank: int = 0) -> int:
    """The receiver of (DP rank, TP rank) as an offset from the worker's KV port."""
    return data_parallel_rank * tensor_parallel_size + tensor_rank


def kv_receivers(data_parallel_ranks: int, tensor_parallel_size: int) -> int:
    """KV ports a worker listens on: one per rank of each of its DP ranks."""
    return max(1, data_parallel_ranks) * tensor_parallel_size


def data_parallel_kv_address(
    kv_address: str, data_parallel_rank: int, tensor_parallel_size: int
) -> str:
    """Where DP rank `data_parallel_rank`'s first receiver listens, given the worker's KV
    address (host:port): its TP rank r is at + r."""
    host, port = kv_address.rsplit(":", 1)
    return f"{host}:{int(port) + kv_rank_offset(data_parallel_rank, tensor_parallel_size)}"
