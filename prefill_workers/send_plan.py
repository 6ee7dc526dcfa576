"""Which blocks a prefill worker sends after each engine step (scheduler side).

A request with `SendKv` params has its blocks sent as its prompt is computed: blocks touched by
each step are sent after that step's forward (so long prompts split by chunked prefill stream
chunk by chunk), starting from block 0 so a local prefix-cache hit is sent too, or from the first
block the decode worker does not hold already (`skip_tokens`: router/flow/disaggregation.py).
"""

from dataclasses import dataclass

from kv_transfer.metadata import SendSlice
from kv_transfer.params import SendKv, from_request, skipped_blocks


@dataclass(frozen=True)
class Sending:
    params: SendKv
    prompt_len: int
    done: int  # prompt tokens computed (and so sent) before this step


class SendPlan:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sending: dict[str, Sending] = {}  # vLLM request id -> progress

    def sends(self, scheduler_output) -> list[SendSlice]:
        """The slices to send after this step's forward pass."""
        for new in scheduler_output.scheduled_new_reqs:
            params = from_request(_extra_kv_params(new.sampling_params))
            if isinstance(params, SendKv):
                self.sending[new.req_id] = Sending(params, len(new.prompt_token_ids), 0)
        sends = []
        for req_id, state in list(self.sending.items()):
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            block_ids = _block_ids(scheduler_output, req_id)
            if not scheduled or block_ids is None:
                continue
            progress = _computed_before(scheduler_output, req_id, state.done) + scheduled
            skipped = skipped_blocks(state.params.skip_tokens, state.prompt_len, self.block_size)
            first = max(state.done // self.block_size, skipped)
            last_block = (min(progress, state.prompt_len) - 1) // self.block_size
            finished = progress >= state.prompt_len
            if last_block < first:  # all of this step's blocks are the decode worker's already
                self.sending[req_id] = Sending(state.params, state.prompt_len, progress)
                continue
            sends.append(
                SendSlice(
                    state.params.transfer_id,
                    state.params.receivers,
                    first,
                    block_ids[first : last_block + 1],
                    finished,
                    state.params.decode_tp,
                    state.params.transport,
                )
            )
            if finished:
                del self.sending[req_id]
            else:
                self.sending[req_id] = Sending(state.params, state.prompt_len, progress)
        return sends

    def forget(self, req_id: str) -> None:
        self.sending.pop(req_id, None)


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
