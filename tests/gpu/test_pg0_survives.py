"""T1 (scripts/gpu_t1_pg0_kill.py, review §3.1): a pdserve NCCL group whose operation times out
beside a vLLM-like process group 0 leaves the process alive. Its two processes start before the
first check (tests/gpu/conftest.py: pg0_check) and this test, run last, judges them."""

import pytest

pytestmark = pytest.mark.gpu


def test_process_group_0_survives_a_kv_groups_failure(device, pg0_check, record_property):
    if device.type != "cuda":
        pytest.skip("CUDA only: torch's ProcessGroupNCCL watchdog and heartbeat monitor")
    record_property("detail", pg0_check.result())
