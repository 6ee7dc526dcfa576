"""PdserveConnector: the vLLM KV connector, loaded by module path.

    kv_transfer_config = {"kv_connector": "PdserveConnector",
                          "kv_connector_module_path": "kv_transfer.connector",
                          "kv_role": "kv_producer" | "kv_consumer",
                          "kv_load_failure_policy": "recompute" | "fail",
                          "kv_connector_extra_config": {"receiver_host": ..., "receiver_port": ...}}

vLLM makes one instance in its engine-core process (role SCHEDULER) and one per worker process
(role WORKER); this class only routes each call to the half that owns it.
"""

import logging
import sys
from pathlib import Path

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorRole)

from kv_transfer.compatibility import Compatibility
from kv_transfer.grpc_transport import KvReceiver, KvSender
from kv_transfer.scheduler_side import SchedulerSide
from kv_transfer.stats import PdserveKvStats
from kv_transfer.worker_side import WorkerSide

log = logging.getLogger("pdserve.kv")
GIL_SWITCH_INTERVAL_S = 0.0002


def compatibility_of(vllm_config) -> Compatibility:
    import vllm

    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    return Compatibility(
        model=Path(model.model).name,
        dtype=str(model.dtype).removeprefix("torch."),
        block_size=vllm_config.cache_config.block_size,
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_size=model.get_head_size(),
        kv_layout="[blocks, kv_heads, block_size, 2*head_size]",
        vllm_version=vllm.__version__,
        tensor_parallel_size=parallel.tensor_parallel_size,
    )


class PdserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.scheduler_side = None
        self.worker_side = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config.cache_config.block_size)
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        compatibility = compatibility_of(vllm_config)
        rank = get_tensor_model_parallel_rank()
        sender = receiver = None
        if transfer.is_kv_producer:
            sender = KvSender(compatibility)
        if transfer.is_kv_consumer:
            # vLLM's worker loop spins in Python while a request waits for KV; with the default
            # 5 ms GIL switch interval each KV message waited up to 5 ms for the GIL there
            # (0.45 s for 30 layers).
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            receiver = KvReceiver(compatibility)
            host = transfer.get_from_extra_config("receiver_host", "127.0.0.1")
            port = int(transfer.get_from_extra_config("receiver_port", 0))
            bound = receiver.start(host, port + rank if port else 0)
            log.info("KV receiver (rank %d) listening on %s:%d", rank, host, bound)
        self.worker_side = WorkerSide(sender, receiver, rank)

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.metadata = connector_metadata

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self.worker_side.metadata = None

    def start_load_kv(self, forward_context, **kwargs):
        pass  # slices are loaded as they arrive, in get_transfer_results

    def wait_for_layer_load(self, layer_name):
        pass  # the whole prompt is loaded before the request is scheduled

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.worker_side.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self):
        pass  # save_kv_layer already copied the blocks out

    def get_transfer_results(self, finished_req_ids):
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        loaded, failed = self.worker_side.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=loaded,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving

    def get_kv_connector_stats(self):
        if self.worker_side is None:
            return None
        transfers = self.worker_side.take_stats()
        return PdserveKvStats(data={"transfers": transfers}) if transfers else None

    def shutdown(self):
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # Scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        self.scheduler_side.request_finished(request)
        return False, None  # the prefill side copied its blocks out already
