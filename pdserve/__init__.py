"""pdserve's shared packages: the worker runtime, settings, the control plane, the model store,
bench and planner. The role folders (router, prefill_workers, decode_workers, kv_transfer) sit
beside it."""
