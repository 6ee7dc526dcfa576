"""The heap a process holds once it serves, frozen: the collector's full passes skip it.

A full collection (CPython's oldest generation) walks every object the process tracks, and
every request the process serves waits meanwhile. In a worker, with torch and vLLM imported,
that is ~660,000 objects and 300-400 ms on this host's cores; in the router ~136,000 objects and
40-90 ms, one every few seconds at 800 requests a second (docs/benchmarking.md). vLLM's API
server freezes its heap once started for the same reason (its lifespan's `freeze_gc_heap`);
a pdserve worker runs vLLM's engine client in a process of its own, where nothing did. What
the process makes afterwards is collected as before.
"""

import gc
import logging
import time

log = logging.getLogger("pdserve")


def freeze_startup_heap() -> None:
    """Collect what is garbage already, then exempt every object left from the collector."""
    began = time.perf_counter()
    gc.collect()
    gc.freeze()
    took_ms = 1000 * (time.perf_counter() - began)
    log.info(
        "startup heap frozen: %d objects (one full collection took %.0f ms)",
        gc.get_freeze_count(),
        took_ms,
    )
