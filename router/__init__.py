"""The front door: the OpenAI API over HTTP (SSE streaming), tokenization, the worker pool,
routing, and the router's Prometheus metrics. It never touches KV bytes."""
