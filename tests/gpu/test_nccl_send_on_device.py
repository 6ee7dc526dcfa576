"""T4: the nccl transport's sending half on one GPU (its two-GPU run is the nccl transport's
transfer): slices staged on the device with their digest computed there by the sending thread,
received as device tensors whose digest the inbox checks on the device, scattered from there."""

import pytest

from tests.gpu.transfer import assert_exact, transfer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2)])
def test_t4_the_nccl_sending_half_stays_on_the_device(
    device, prefill_tp, decode_tp, record_property
):
    if device.type != "cuda":
        pytest.skip("CUDA only: on CPU the nccl transport sends host tensors over gloo")
    (outcome,) = transfer(
        device, transport="nccl", prefill_tp=prefill_tp, decode_tp=decode_tp, loopback=True
    )
    record_property("detail", "staged and checked on the device; " + assert_exact(outcome))
