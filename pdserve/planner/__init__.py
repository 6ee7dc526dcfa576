"""Capacity planning for pdserve: capacity math per GPU type, step-time cost models, a
discrete-event simulator of the P/D cluster, and the prefill:decode search behind
`pdserve plan --gpus`."""
