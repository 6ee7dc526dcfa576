"""Code shared by the router and the workers: the command line, the model cache, the engine
factory, the worker gRPC protocol and its client, and the single-host `serve` launcher."""
