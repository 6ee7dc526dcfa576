"""The worker runtime both roles run in: the `pdserve worker` process, its gRPC service and
protocol, the engine factory, registry membership, and how child processes start and stop."""
