"""GB/s of device->pinned (staging) and pinned->device (loading) through the real staging
classes, beside the device's own device->device copy: a figure for the report, and the bytes
loaded back must be those staged."""

import statistics
import time
from collections.abc import Callable

import pytest
import torch

from kv_transfer.host_staging import DeviceToHost, HostToDevice

pytestmark = pytest.mark.gpu

REPEATS = 5


def test_staging_bandwidth(device, record_property):
    megabytes = 256 if device.type == "cuda" else 64
    nbytes = megabytes << 20
    source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    staging = DeviceToHost(device, 2 * nbytes + (1 << 20))
    loader = HostToDevice(device)
    rates: dict[str, list[float]] = {"D2H": [], "H2D": [], "D2D": []}

    def timed(name: str, run: Callable[[], object], moved: int = nbytes) -> object:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates[name].append(moved / (time.perf_counter() - started) / 1e9)
        return result

    index = torch.zeros(1, dtype=torch.long)
    for _ in range(REPEATS):
        staged = timed("D2H", lambda: staging.stage(lambda: source))  # the copy, synced
        host = staged.ready()
        timed(
            "H2D",
            lambda host=host: (
                loader.load(host, index, lambda w, i: target.copy_(w)),
                loader.wait(),
            ),
        )
        staged.release()
        timed("D2D", lambda: target.copy_(source), 2 * nbytes)
    assert torch.equal(target, source), "the bytes loaded back differ from those staged"
    if device.type == "cpu":  # the wire tensor is the host tensor: nothing is staged
        del rates["D2H"]
    medians = {name: statistics.median(values) for name, values in rates.items()}
    record_property(
        "detail",
        f"{megabytes} MiB, median of {REPEATS}: "
        + ", ".join(f"{name} {rate:.1f} GB/s" for name, rate in medians.items()),
    )
