"""The GPU checks: pdserve's KV data plane on a real device (pytest marker `gpu`), run on the CPU
in CI and on CUDA by scripts/gpu_check.py on a GPU machine; torch, grpcio and protobuf only."""
