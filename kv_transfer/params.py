"""What a request carries for the connector, in vLLM's `kv_transfer_params`.

The router puts a `SendKv` in the prefill request and a `ReceiveKv` in the decode request, with
the same transfer id (vLLM renames request ids internally, so they cannot be the key). They
travel as plain dicts (vLLM serialises them with msgpack) under the key "pdserve".
"""

from dataclasses import asdict, dataclass

from pdserve.core.kinds import Transport
from pdserve.protocol.data_parallel import data_parallel_kv_address

KEY = "pdserve"


@dataclass(frozen=True)
class SendKv:
    """Prefill side: push this request's KV, layer by layer, to `destination`."""

    transfer_id: str
    destination: str  # host:port of the decode worker's KV receiver (rank r: port + r)
    decode_tp: int = 1  # the decode worker's tensor-parallel size
    transport: str = Transport.GRPC  # a pdserve.core.kinds.Transport (a string on the wire)
    skip_tokens: int = 0  # the decode worker holds these already: their whole blocks stay here
    decode_dp_rank: int = 0  # the decode worker's data-parallel rank that takes the request

    @property
    def receivers(self) -> str:
        """Where that rank's first KV receiver listens (its tensor-parallel rank r: + r): a
        data-parallel rank's receivers follow the rank before's, as vLLM's NixlConnector's side
        channel port is its base + the DP index (pdserve/protocol/data_parallel.py)."""
        return data_parallel_kv_address(self.destination, self.decode_dp_rank, self.decode_tp)


@dataclass(frozen=True)
class ReceiveKv:
    """Decode side: the KV of the first `num_tokens` prompt tokens arrives from a prefill
    worker within `timeout_s` (the prompt may go on with the prefill's first token)."""

    transfer_id: str
    timeout_s: float
    num_tokens: int
    prefill_tp: int = 1  # the prefill worker's tensor-parallel size
    skip_tokens: int = 0  # held here already, so not sent: a worker holding fewer computes


def skipped_blocks(skip_tokens: int, prompt_tokens: int, block_size: int) -> int:
    """The leading blocks of a prompt that neither leg of a transfer sends: the whole blocks of
    `skip_tokens`, never the block holding the prompt's last token (both legs count alike)."""
    return min(skip_tokens // block_size, (prompt_tokens - 1) // block_size)


def to_extra_args(params: SendKv | ReceiveKv) -> dict:
    role = "send" if isinstance(params, SendKv) else "receive"
    return {"kv_transfer_params": {KEY: {"role": role, **asdict(params)}}}


def from_request(kv_transfer_params: dict | None) -> SendKv | ReceiveKv | None:
    fields = dict((kv_transfer_params or {}).get(KEY) or {})
    role = fields.pop("role", None)
    if role == "send":
        return SendKv(**fields)
    if role == "receive":
        return ReceiveKv(**fields)
    return None
