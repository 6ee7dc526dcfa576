"""Memory the KV data plane holds beside the KV cache, which a layout must leave room for
(pdserve/planner/memory_fit.py counts it; no torch here, so the control plane reads it without
loading torch)."""

INBOX_BYTES = 1 << 30  # KV received and not yet loaded into the cache, per decode rank
