"""PoolConnector: vLLM's OffloadingConnector over the host KV pool (kv_transfer/pool_offload.py),
for a worker whose engine stores what it computes in the pool and loads what the pool has.

    kv_transfer_config = {"kv_connector": "PoolConnector",
                          "kv_connector_module_path": "kv_transfer.pool_connector",
                          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                          "kv_connector_extra_config": pool_extra_config(address, namespace)}

What it adds to vLLM's: a block whose bytes fail the pool's check is reported as a load error
(vLLM 0.32's offloading worker has no failed transfers: it asserts success), so the scheduler
recomputes it instead of using it.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)

from kv_transfer.pool_offload import POOL_ADDRESS, POOL_NAMESPACE


def pool_extra_config(address: str, namespace: str) -> dict:
    return {
        "spec_name": "PoolOffloadingSpec",
        "spec_module_path": "kv_transfer.pool_offload",
        POOL_ADDRESS: address,
        POOL_NAMESPACE: namespace,
        "offload_prompt_only": False,  # a conversation's next turn resends the answers too
    }


class PoolConnector(OffloadingConnector):
    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker.take_failed_blocks() if worker is not None else set()
