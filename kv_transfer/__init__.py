"""KV cache transfer between prefill and decode workers: the vLLM KV connector (producer and
consumer halves), its wire format and gRPC transport, and the compatibility handshake."""
