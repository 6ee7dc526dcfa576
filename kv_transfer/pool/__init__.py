"""The host KV pool: a store process per host holding KV blocks any of its workers computed, its
client, index, copies, peers and vLLM offloading connector."""
