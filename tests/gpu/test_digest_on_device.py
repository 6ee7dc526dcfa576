"""The integrity digest computed on the device equals the CPU's and catches a flipped bit."""

import time

import pytest
import torch

from kv_transfer.integrity import slice_digest

pytestmark = pytest.mark.gpu


def test_the_digest_on_the_device_equals_the_cpus_and_catches_a_flipped_bit(
    device, record_property
):
    data = torch.randint(0, 256, ((3 << 20) + 5,), dtype=torch.uint8, device=device)
    here, on_host = slice_digest(data), slice_digest(data.cpu())
    flipped = data.clone()
    flipped[12345] ^= 4
    assert here == on_host, f"{device.type} digest {here:#x} != CPU digest {on_host:#x}"
    assert slice_digest(flipped) != here, "a flipped bit left the digest unchanged"
    started = time.perf_counter()
    for _ in range(5):
        slice_digest(data)
    rate = 5 * data.numel() / (time.perf_counter() - started) / 1e9
    record_property("detail", f"equal to the CPU's, a flipped bit caught, {rate:.1f} GB/s")
