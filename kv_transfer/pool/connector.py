"""PoolConnector: vLLM's OffloadingConnector over the host KV pool (kv_transfer/pool/offload.py),
for a worker whose engine stores what it computes in the pool and loads what the pool has.

    kv_transfer_config = kv_transfer.pool.config.pool_kv_transfer_config(address, namespace)

What it adds to vLLM's: a block whose bytes fail the pool's check is reported as a load error
(vLLM 0.32's offloading worker has no failed transfers: it asserts success), so the scheduler
recomputes it instead of using it.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)


class PoolConnector(OffloadingConnector):
    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        return worker.take_failed_blocks() if worker is not None else set()
