"""What the scheduler half of the connector tells its worker half each engine step: the slices
to send and the transfers to expect (kv_transfer/connector_base.py's PdserveMetadata carries
them; this module imports no vLLM, so the data plane's classes import without it).

vLLM pickles this from the engine-core process to the worker process(es); request ids here are
vLLM's internal ones, transfer ids are pdserve's (shared by the prefill and decode requests).
"""

from dataclasses import dataclass

from pdserve.core.kinds import Transport


@dataclass(frozen=True)
class SendSlice:
    """Prefill side: after this step's forward, send blocks [first_block, first_block +
    len(block_ids)) of the request, layer by layer, to `destination`."""

    transfer_id: str
    destination: str
    first_block: int  # request-relative index of block_ids[0]
    block_ids: list[int]  # engine block ids, in request order
    last: bool  # this step completes the prompt
    decode_tp: int = 1  # the decode worker's TP: which of its ranks get which heads
    transport: str = Transport.GRPC  # what carries it (kv_transfer/transport.py)


@dataclass(frozen=True)
class Expected:
    """Decode side: KV for `transfer_id` goes into `block_ids` (request order); the first
    `skip_blocks` already hold this worker's own prefix-cache hit and are left alone."""

    req_id: str
    transfer_id: str
    block_ids: list[int]
    skip_blocks: int
    timeout_s: float
    prefill_tp: int = 1  # the prefill worker's TP: which of its ranks send which heads
