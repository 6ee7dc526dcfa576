"""The benchmark client `pdserve bench`: workloads, arrival processes, a streaming OpenAI client,
and the metrics (TTFT, TPOT, ITL, E2E, goodput) and reports computed from what it recorded."""
