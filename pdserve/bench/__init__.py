"""The benchmark client `pdserve bench` (workloads, arrivals, a streaming OpenAI client, metrics
and reports) and `pdserve sweep`, which runs it over prefill:decode ratios and request rates."""
