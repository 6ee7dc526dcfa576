"""Which KV transport a worker pair uses (pdserve/protocol/transport_choice.py)."""

import pytest

from pdserve.core.kinds import Transport
from pdserve.protocol.transport_choice import choose_transport


@pytest.mark.parametrize(
    "prefill, decode, same_host, both_cuda, chosen",
    [
        ("auto", "auto", True, False, "shm"),
        ("auto", "auto", False, False, "grpc"),
        ("auto", "auto", False, True, "nccl"),
        ("auto", "auto", True, True, "nccl"),  # NVLink beats host memory
        ("grpc", "auto", True, False, "grpc"),
        ("auto", "shm", False, False, "shm"),  # forced: the channel says why it cannot
        ("nccl", "grpc", True, False, "nccl"),  # the sender's choice wins
        ("", "", True, False, "shm"),  # a worker too old to say: auto
    ],
)
def test_which_transport_a_pair_uses(prefill, decode, same_host, both_cuda, chosen):
    assert choose_transport(prefill, decode, same_host, both_cuda) == chosen


def test_the_choice_is_a_transport_member():
    assert choose_transport("auto", "auto", True, False) is Transport.SHM
    assert choose_transport("nccl", "auto", False, False) is Transport.NCCL
