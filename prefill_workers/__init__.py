"""What only a prefill worker does: its vLLM KV connector (the producer), the send plan on the
scheduler side, and the per-layer KV sender on the worker side."""
