"""Which KV a decode worker waits for (scheduler side).

A request with `ReceiveKv` params is admitted for the tokens whose KV is sent: the whole prompt
(vLLM then recomputes its last position to sample), or the prompt before the prefill's first
token (the decode worker then computes only that one). When every rank already holds its KV
(`arrived`: decode_workers/arrivals.py, the common case, as the router sends the decode leg once
the prefill has returned its first token), the load is synchronous: vLLM schedules the request
in this very step and the worker side loads the KV before the step's forward pass (an `Expected`
entry in `loads` of this step's metadata). vLLM computes at least one token of a request it
schedules, so such a load stops one token short of the request's tokens. Otherwise the request
is admitted as "loading asynchronously", its reserved blocks go to the worker side in
`expected`, and it is scheduled in a step after the one that loaded its KV.

The router may have the prefill worker skip the prompt's leading blocks that it expects this
worker to hold already (`skip_tokens`). If this worker's prefix cache holds fewer (they were
evicted, or the router's estimate was wrong), the blocks in between will come from nowhere: the
request is computed here instead, as without a transfer, and the worker side is told to drop
what the prefill worker sends for it (`abandoned`).
"""

from collections.abc import Callable

from kv_transfer.metadata import Expected
from kv_transfer.params import ReceiveKv, from_request, skipped_blocks


def never(params: ReceiveKv) -> bool:
    return False


class LoadPlan:
    def __init__(self, block_size: int, arrived: Callable[[ReceiveKv], bool] = never) -> None:
        """`arrived(params)`: whether every rank holds the transfer's KV already."""
        self.block_size = block_size
        self.arrived = arrived
        self.receiving: set[str] = set()  # vLLM request ids admitted as loading
        self.computing: set[str] = set()  # ... computed here: the skipped blocks are not here
        self.loading_now: dict[str, int] = {}  # request id -> its local hit, while answered sync
        self.expected: list[Expected] = []  # asynchronous loads, not yet told to the worker side
        self.loads: list[Expected] = []  # loads in this step, not yet told to the worker side
        self.abandoned: list[str] = []  # transfer ids no request waits for, not yet told

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params, req_id = from_request(request.kv_transfer_params), request.request_id
        answered = req_id in self.receiving or req_id in self.computing
        if not isinstance(params, ReceiveKv) or answered:
            return 0, False  # also after a failed load, or once computing: the engine computes
        skipped = skipped_blocks(params.skip_tokens, params.num_tokens, self.block_size)
        if num_computed_tokens < skipped * self.block_size:
            self.computing.add(req_id)
            self.abandoned.append(params.transfer_id)
            return 0, False
        count = params.num_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        if self.arrived(params):
            now = min(params.num_tokens, request.num_tokens - 1) - num_computed_tokens
            if now > 0:
                self.loading_now[req_id] = num_computed_tokens
                return now, False
        self.loading_now.pop(req_id, None)
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = from_request(request.kv_transfer_params)
        if not isinstance(params, ReceiveKv) or num_external_tokens == 0:
            return
        if request.request_id in self.receiving:
            return
        self.receiving.add(request.request_id)
        block_ids = blocks.get_block_ids()[0]
        local = self.loading_now.pop(request.request_id, None)
        if local is None:  # loading asynchronously: only the local hit's blocks are hashed yet
            skip, entries = len(block_ids) - len(blocks.get_unhashed_block_ids()), self.expected
        else:  # vLLM hashed the blocks this step fills already: the local hit says which
            skip, entries = local // self.block_size, self.loads
        entries.append(
            Expected(
                request.request_id,
                params.transfer_id,
                list(block_ids),
                skip,
                params.timeout_s,
                params.prefill_tp,
            )
        )

    def take_expected(self) -> list[Expected]:
        expected, self.expected = self.expected, []
        return expected

    def take_loads(self) -> list[Expected]:
        loads, self.loads = self.loads, []
        return loads

    def take_abandoned(self) -> list[str]:
        abandoned, self.abandoned = self.abandoned, []
        return abandoned

    def forget(self, req_id: str) -> None:
        self.receiving.discard(req_id)
        self.computing.discard(req_id)
        self.loading_now.pop(req_id, None)
