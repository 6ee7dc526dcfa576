"""Which KV a decode worker waits for (scheduler side).

A request with `ReceiveKv` params is admitted as "loading asynchronously" for the tokens whose
KV is sent: the whole prompt (vLLM then recomputes its last position to sample), or the prompt
before the prefill's first token (the decode worker then computes only that one). Its reserved
blocks go to the worker side as an `Expected` entry in the next step's metadata.
"""

from kv_transfer.metadata import Expected
from kv_transfer.params import ReceiveKv, from_request


class LoadPlan:
    def __init__(self) -> None:
        self.receiving: set[str] = set()  # vLLM request ids admitted as loading
        self.expected: list[Expected] = []  # not yet told to the worker side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = from_request(request.kv_transfer_params)
        if not isinstance(params, ReceiveKv) or request.request_id in self.receiving:
            return 0, False  # also after a failed load: the engine recomputes locally
        count = params.num_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        params = from_request(request.kv_transfer_params)
        if not isinstance(params, ReceiveKv) or num_external_tokens == 0:
            return
        if request.request_id in self.receiving:
            return
        self.receiving.add(request.request_id)
        block_ids = blocks.get_block_ids()[0]
        fresh = len(blocks.get_unhashed_block_ids())
        self.expected.append(
            Expected(
                request.request_id,
                params.transfer_id,
                list(block_ids),
                len(block_ids) - fresh,
                params.timeout_s,
                params.prefill_tp,
            )
        )

    def take_expected(self) -> list[Expected]:
        expected, self.expected = self.expected, []
        return expected

    def forget(self, req_id: str) -> None:
        self.receiving.discard(req_id)
