"""The ground floor every part of pdserve stands on: the names that cross processes (kinds),
tracing, progress output, GPU specs, KV pool keys, the async fan-out; it imports nothing of
pdserve."""
