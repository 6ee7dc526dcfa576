"""The connector's scheduler half (vLLM's engine-core process): which blocks to send or expect.

Prefill: a request with `SendKv` params has its blocks sent as its prompt is computed; blocks
touched by each step are sent after that step's forward (so long prompts split by chunked
prefill stream chunk by chunk), starting from block 0 so a local prefix-cache hit is sent too.
Decode: a request with `ReceiveKv` params is admitted as "loading asynchronously" for the
tokens whose KV is sent: the whole prompt (vLLM then recomputes its last position to sample),
or the prompt before the prefill's first token (the decode worker then computes only that one).
"""

import logging

from kv_transfer.metadata import Expected, PdserveMetadata, SendSlice
from kv_transfer.params import ReceiveKv, SendKv, from_request

log = logging.getLogger("pdserve.kv")


class SchedulerSide:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sending: dict[str, tuple[SendKv, int, int]] = {}  # req id -> params, prompt len, done
        self.receiving: set[str] = set()  # decode requests admitted as loading
        self.expected: list[Expected] = []

    # Decode side ---------------------------------------------------------------------------

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
        self.expected.append(Expected(request.request_id, params.transfer_id, list(block_ids),
                                      len(block_ids) - fresh, params.timeout_s))

    # Prefill side --------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output) -> PdserveMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            params = from_request(_extra_kv_params(new.sampling_params))
            if isinstance(params, SendKv):
                self.sending[new.req_id] = (params, len(new.prompt_token_ids), 0)
        sends = []
        for req_id, (params, prompt_len, done) in list(self.sending.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            block_ids = _block_ids(scheduler_output, req_id)
            if not scheduled or block_ids is None:
                continue
            progress = _computed_before(scheduler_output, req_id, done) + scheduled
            first = done // self.block_size
            last_block = (min(progress, prompt_len) - 1) // self.block_size
            finished = progress >= prompt_len
            sends.append(SendSlice(params.transfer_id, params.destination, first,
                                   block_ids[first:last_block + 1], finished))
            if finished:
                del self.sending[req_id]
            else:
                self.sending[req_id] = (params, prompt_len, progress)
        metadata = PdserveMetadata(sends=sends, expected=self.expected)
        self.expected = []
        return metadata

    def request_finished(self, request) -> None:
        self.sending.pop(request.request_id, None)
        self.receiving.discard(request.request_id)


def _extra_kv_params(sampling_params) -> dict | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get("kv_transfer_params")


def _block_ids(scheduler_output, req_id: str) -> list[int] | None:
    state = scheduler_output.kv_connector_block_state
    groups = state.get_block_ids(req_id) if state is not None else None
    return list(groups[0]) if groups else None


def _computed_before(scheduler_output, req_id: str, done: int) -> int:
    """Tokens computed before this step: the prefix-cache hit on a new request, else what
    earlier steps did."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id == req_id:
            return new.num_computed_tokens
    return done
