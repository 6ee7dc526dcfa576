"""Capacity planning for pdserve: weights, KV cache, concurrency and step-time math per GPU type.
Later also the workload simulator and the prefill:decode ratio search behind `pdserve plan`."""
