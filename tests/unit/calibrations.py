"""Calibrations the planner's tests plan with (made-up figures, named as such)."""

from dataclasses import replace

from pdserve.planner.calibration import Calibration

# Two workers of one core each (shared figures, slowing each other by 20%) and one worker with
# both cores (alone) twice as fast at everything.
TWO_CORES = Calibration(
    model="smollm2",
    measured_on="made up for the tests",
    prefill_base_s=0.02,
    prefill_per_token_s=0.0015,
    decode_base_s=0.03,
    decode_per_request_s=0.002,
    prefill_contention=0.2,
    decode_contention=0.2,
    workers_per_host=2,
    kv_capacity_tokens=30_000,
    block_size=128,
    alone_prefill_base_s=0.01,
    alone_prefill_per_token_s=0.00075,
    alone_decode_base_s=0.015,
    alone_decode_per_request_s=0.001,
)

# The same two workers, and one worker with both cores only 1.4x faster at prefill and 1.15x at
# decode (about what a 2-core CPU host measured: scripts/validate_simulator.py).
MODEST_LONE = replace(
    TWO_CORES,
    alone_prefill_base_s=TWO_CORES.prefill_base_s / 1.4,
    alone_prefill_per_token_s=TWO_CORES.prefill_per_token_s / 1.4,
    alone_decode_base_s=TWO_CORES.decode_base_s / 1.15,
    alone_decode_per_request_s=TWO_CORES.decode_per_request_s / 1.15,
)

# A calibration as `pdserve calibrate` writes one: its shared step costs are those of
# test_planner_calibration's KNOWN, a lone worker is faster, and workers on a host slow each other.
CALIBRATION = Calibration(
    model="smollm2",
    measured_on="test",
    prefill_base_s=0.05,
    prefill_per_token_s=0.002,
    decode_base_s=0.03,
    decode_per_request_s=0.004,
    prefill_contention=0.4,
    decode_contention=0.7,
    workers_per_host=2,
    kv_capacity_tokens=26214,
    block_size=128,
    alone_prefill_base_s=0.03,
    alone_prefill_per_token_s=0.0012,
    alone_decode_base_s=0.025,
    alone_decode_per_request_s=0.003,
)
