"""The GPU checks' devices: every check that takes `device` runs once per device asked for
(`--check-device`; by default the CPU, and CUDA when present), and T1's processes start before
the first check so that their ~80 s of waiting overlaps the others."""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.gpu.script_module import script_module

if TYPE_CHECKING:  # torch is imported where a check needs it: not in pytest-xdist's controller
    import torch

T1_TEST = "test_process_group_0_survives_a_kv_groups_failure"


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--check-device",
        choices=("cpu", "cuda"),
        help="run tests/gpu's checks on this device alone (default: the CPU, and CUDA if present)",
    )


def pytest_generate_tests(metafunc) -> None:
    if "device" in metafunc.fixturenames:
        import torch

        asked = metafunc.config.getoption("--check-device")
        present = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        metafunc.parametrize("device", [asked] if asked else present, indirect=True)


def pytest_collection_modifyitems(items) -> None:
    """T1's test last: it collects processes started before the first check."""
    items.sort(key=lambda item: getattr(item, "originalname", "") == T1_TEST)


@pytest.fixture
def device(request) -> Iterator["torch.device"]:
    """The check's device. On CUDA the check's "forward" (what its own thread queues, as vLLM's
    engine thread does) runs on a dedicated current stream, as vLLM runs its forward
    (vllm/utils/torch_utils.py): a check on the default stream would hide work put on the wrong
    stream."""
    import torch

    device = torch.device(request.param)
    if device.type != "cuda":
        yield device
        return
    torch.cuda.set_stream(torch.cuda.Stream(device))
    try:
        yield device
    finally:
        torch.cuda.current_stream(device).synchronize()
        torch.cuda.set_stream(torch.cuda.default_stream(device))


@pytest.fixture(scope="session", autouse=True)
def pg0_check(request) -> Iterator[object | None]:
    """T1's two processes (scripts/gpu_t1_pg0_kill.py, ~80 s, mostly waiting), started before the
    first check of a session that runs T1 on CUDA, judged by T1's test (run last), killed at the
    session's end if still running; None in a session that does not run T1 on CUDA."""
    runs_t1 = any(
        getattr(item, "originalname", "") == T1_TEST and item.callspec.params["device"] == "cuda"
        for item in request.session.items
    )
    if not runs_t1:
        yield None
        return
    import torch

    check = script_module("gpu_t1_pg0_kill").Pg0Check(torch.device("cuda"))
    check.start()
    try:
        yield check
    finally:
        check.stop()
