"""How a worker's engine joins its host's KV pool: the vLLM kv_transfer_config that names
pdserve's PoolConnector (kv_transfer/pool/connector.py) and its offloading spec
(kv_transfer/pool/offload.py). No vLLM import: the worker builds this before vLLM loads."""

POOL_ADDRESS = "pool_address"  # kv_connector_extra_config's keys for the pool
POOL_NAMESPACE = "pool_namespace"


def pool_kv_transfer_config(address: str, namespace: str) -> dict:
    """`namespace` is what else must match for two engines' block hashes to mean the same
    KV (the spec adds the model, dtype, block size and layout)."""
    return {
        "kv_connector": "PoolConnector",
        "kv_connector_module_path": "kv_transfer.pool.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a block that fails its check is computed
        "kv_connector_extra_config": {
            "spec_name": "PoolOffloadingSpec",
            "spec_module_path": "kv_transfer.pool.offload",
            POOL_ADDRESS: address,
            POOL_NAMESPACE: namespace,
            # A conversation's next turn resends the answers too: store them as well.
            "offload_prompt_only": False,
        },
    }
