"""Which KV transport a prefill -> decode pair uses, from what both workers say in Health.

A pure function of the Health fields (kv_transport, host_id, device), so the router can choose
without importing the data plane (kv_transfer/), which carries out the choice.
"""

from pdserve.core.kinds import AUTO_TRANSPORT, Transport


def choose_transport(
    prefill_setting: str,
    decode_setting: str,
    same_host: bool,
    both_cuda: bool,
) -> Transport:
    """The transport for one prefill -> decode pair. A worker's setting other than `auto`
    forces it (the prefill worker's first, as it sends); with both on `auto`: NCCL between GPU
    workers (device to device, over NVLink on one host), shared memory between CPU workers on
    one host, gRPC otherwise."""
    for setting in (prefill_setting, decode_setting):
        if setting and setting != AUTO_TRANSPORT:
            return Transport(setting)
    if both_cuda:
        return Transport.NCCL
    return Transport.SHM if same_host else Transport.GRPC
