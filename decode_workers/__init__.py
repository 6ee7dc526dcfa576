"""What only a decode worker does: its vLLM KV connector (the consumer), the load plan on the
scheduler side, and the KV loader (deadlines, cancels, orphans, the recompute/fail policy)."""
