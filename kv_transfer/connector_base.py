"""What pdserve's two vLLM KV connectors share: layer bookkeeping, metadata binding, stats.

vLLM makes one connector in its engine-core process (role SCHEDULER) and one per worker
process (role WORKER, one per tensor-parallel rank). A prefill worker runs
`prefill_workers.connector.PrefillConnector`, a decode worker
`decode_workers.connector.DecodeConnector`; each overrides only the calls its role answers,
and this base answers the rest with "nothing to do".
"""

import logging
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.attention_support import check_attention
from kv_transfer.kv_layout import WIRE_LAYOUT, LayerLayout, find_layout, memory_order
from kv_transfer.metadata import Expected, SendSlice
from kv_transfer.stats import PdserveKvStats

log = logging.getLogger("pdserve.kv")


@dataclass
class PdserveMetadata(KVConnectorMetadata):
    """One engine step's word from the scheduler half to the worker half (vLLM pickles it from
    the engine-core process to the worker processes): what to send, what to expect."""

    sends: list[SendSlice] = field(default_factory=list)
    expected: list[Expected] = field(default_factory=list)
    abandoned: list[str] = field(default_factory=list)  # transfers computed here instead


def _log_to_stderr() -> None:
    """vLLM's engine-core and worker processes configure only vLLM's loggers: give pdserve's
    its own handler there, so transfer logs reach the worker's log at INFO."""
    root = logging.getLogger("pdserve")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class _NoPromMetrics(KVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict, engine_idx: int = 0) -> None:
        pass


class PdserveConnectorBase(KVConnectorBase_V1):
    # What a pdserve connector loads was sent by another worker: vLLM's stats tell these
    # tokens apart from the host KV pool's (pdserve/worker/engine.py counts the pool's alone).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        self.block_size = vllm_config.cache_config.block_size
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        check_attention(model.model, model.use_mla)  # before any layout is looked for
        self.head_size = model.get_head_size()
        self.total_kv_heads = model.get_total_num_kv_heads()
        self.rank_kv_heads = model.get_num_kv_heads(parallel)
        self.tp = parallel.tensor_parallel_size
        self.kv_caches: list = []  # worker side: each layer's KV cache tensor, by layer index
        self.layer_index: dict[str, int] = {}
        self.layout: LayerLayout | None = None  # worker side: how the caches are laid out
        self.metadata: PdserveMetadata | None = None

    def worker_rank(self) -> int:
        """This worker process's tensor-parallel rank (worker side only)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self.kv_caches = [tensor for _, tensor in ordered]
        self.layer_index = {name: i for i, (name, _) in enumerate(ordered)}
        first = self.kv_caches[0]
        self.layout = find_layout(
            tuple(first.shape), None, self.rank_kv_heads, self.block_size, self.head_size
        )
        log.info(
            "KV caches: %d layers of %s %s on %s, layer view %s, memory order %s; wire %s",
            len(self.kv_caches),
            tuple(first.shape),
            first.dtype,
            first.device,
            self.layout.name,
            memory_order(first, self.layout),
            WIRE_LAYOUT,
        )

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self.metadata = connector_metadata

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self.metadata = None

    def start_load_kv(self, forward_context, **kwargs):
        pass  # a decode worker loads slices as they arrive, in get_transfer_results

    def wait_for_layer_load(self, layer_name):
        pass  # the whole prompt is loaded before the request is scheduled

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass  # only a prefill worker sends

    def wait_for_save(self):
        pass  # save_kv_layer already copied the blocks out

    def get_transfer_results(self, finished_req_ids):
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=set(), failed_recving=set()
        )

    def finished_transfers(self) -> list[dict]:
        """Per-transfer figures since the last call (see kv_transfer/stats.py)."""
        return []

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """None of vLLM's: the worker exports each transfer itself (pdserve/worker/engine.py).
        Beside the KV pool's connector in vLLM's MultiConnector, each connector whose stats it
        sees must have some, or vLLM's metrics fail every request."""
        return _NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self):
        if self.is_scheduler:  # vLLM asks both sides; only the worker side measures
            return None
        transfers = self.finished_transfers()
        return PdserveKvStats(data={"transfers": transfers}) if transfers else None

    # Scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False  # only a decode worker receives KV

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return PdserveMetadata()

    def request_finished(self, request, block_ids):
        return False, None  # a prefill worker copies its blocks out during the forward pass
