"""What pdserve's vLLM KV connectors share: the metadata, the two halves' calls, the wiring.

vLLM makes one connector in its engine-core process (role SCHEDULER) and one per worker
process (role WORKER, one per tensor-parallel rank). Each of pdserve's connectors (a prefill
worker's `prefill_workers.connector.PrefillConnector`, a decode worker's
`decode_workers.connector.DecodeConnector`, a flex worker's both:
`pdserve.worker.flex_connector.FlexConnector`) holds the half of its role that vLLM's process
runs: `scheduler` in the engine core, `worker` in a worker process, the other None (vLLM
NixlConnector's shape). This base passes vLLM's calls to that half; a half answers the calls
its role has something to do in, and inherits "nothing to do" for the rest.
"""

import logging
from dataclasses import dataclass, field, fields

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_transfer.compatibility import cache_heads
from kv_transfer.kv_layout import (
    WIRE_LAYOUT,
    LayerLayout,
    LayoutError,
    find_layout,
    memory_order,
)
from kv_transfer.metadata import Expected, SendSlice
from kv_transfer.stats import PdserveKvStats
from kv_transfer.transfer_report import TRANSFERS, TransferReport

log = logging.getLogger("pdserve.kv")


@dataclass
class PdserveMetadata(KVConnectorMetadata):
    """One engine step's word from the scheduler half to the worker half (vLLM pickles it from
    the engine-core process to the worker processes): what to send, what to expect."""

    sends: list[SendSlice] = field(default_factory=list)
    expected: list[Expected] = field(default_factory=list)  # loaded asynchronously
    loads: list[Expected] = field(default_factory=list)  # loaded before this step's forward
    abandoned: list[str] = field(default_factory=list)  # transfers computed here instead

    @classmethod
    def merge(cls, *halves: "PdserveMetadata") -> "PdserveMetadata":
        """One step's metadata from each half's (a flex worker's prefill and decode halves):
        every field of every half (each is a list), so a field either half fills reaches the
        worker."""
        joined = {f.name: [x for h in halves for x in getattr(h, f.name)] for f in fields(cls)}
        return cls(**joined)


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


@dataclass(frozen=True)
class KvShape:
    """The model's KV geometry both halves plan and copy by, read once from vLLM's config. An
    MLA model's latent cache is one head of `head_size` (kv_lora_rank + rope dim) with kv size
    1, the same on every rank: head_shards then routes each decode rank its copy from one
    prefill rank."""

    block_size: int
    head_size: int
    total_kv_heads: int
    rank_kv_heads: int  # this tensor-parallel rank's share of them
    tp: int
    kv_size: int  # K and V per head-token; 1: an MLA latent

    @classmethod
    def of(cls, vllm_config) -> "KvShape":
        model, parallel = vllm_config.model_config, vllm_config.parallel_config
        total_kv_heads, kv_size = cache_heads(model)
        return cls(
            block_size=vllm_config.cache_config.block_size,
            head_size=model.get_head_size(),
            total_kv_heads=total_kv_heads,
            rank_kv_heads=model.get_num_kv_heads(parallel),
            tp=parallel.tensor_parallel_size,
            kv_size=kv_size,
        )


@dataclass(frozen=True)
class KvCaches:
    """A worker process's KV cache tensors as vLLM registered them: one per layer, in layer
    order, and how each is laid out."""

    layers: list[torch.Tensor]
    index: dict[str, int]  # vLLM's layer name -> its place in `layers`
    layout: LayerLayout

    @classmethod
    def of(cls, kv_caches: dict[str, torch.Tensor], shape: KvShape) -> "KvCaches":
        """Every layer must have the first's shape: a model whose caches differ by layer (a
        sparse-MLA indexer cache beside the latent, say) fails here by name, not mid-transfer."""
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        first = ordered[0][1]
        layout = find_layout(
            tuple(first.shape),
            None,
            shape.rank_kv_heads,
            shape.block_size,
            shape.head_size,
            shape.kv_size,
        )
        for name, tensor in ordered:
            if tensor.shape != first.shape or tensor.dtype != first.dtype:
                raise LayoutError(
                    f"KV cache {name} is {tuple(tensor.shape)} {tensor.dtype}, not "
                    f"{tuple(first.shape)} {first.dtype} as {ordered[0][0]}: pdserve moves "
                    "caches of one shape in every layer"
                )
        log.info(
            "KV caches: %d layers of %s %s on %s, layer view %s, memory order %s; wire %s",
            len(ordered),
            tuple(first.shape),
            first.dtype,
            first.device,
            layout.name,
            memory_order(first, layout),
            WIRE_LAYOUT,
        )
        index = {name: i for i, (name, _) in enumerate(ordered)}
        return cls([tensor for _, tensor in ordered], index, layout)

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


def tensor_parallel_rank() -> int:
    """This worker process's tensor-parallel rank (worker side only)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class SchedulerHalf:
    """The calls vLLM makes in its engine-core process, answered "nothing to do"."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        pass

    def metadata(self, scheduler_output) -> PdserveMetadata:
        """What the worker half does in this step."""
        return PdserveMetadata()

    def request_finished(self, request) -> None:
        pass

    def shutdown(self) -> None:
        pass


class WorkerHalf:
    """The calls vLLM makes in a worker process (one per tensor-parallel rank), answered
    "nothing to do"."""

    def register_kv_caches(self, caches: KvCaches) -> None:
        pass

    def bind(self, metadata: PdserveMetadata) -> None:
        """This step's metadata, before its forward pass."""

    def load_now(self, metadata: PdserveMetadata) -> None:
        """Before this step's forward pass (vLLM's start_load_kv): the KV it computes from."""

    def take_load_errors(self) -> set[int]:
        """Blocks `load_now` could not fill since the last call."""
        return set()

    def save_kv_layer(self, layer_name: str, kv_layer, metadata: PdserveMetadata) -> None:
        pass

    def wait_for_save(self, metadata: PdserveMetadata) -> None:
        pass

    def transfer_results(
        self, metadata: PdserveMetadata, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str]]:
        """(request ids whose KV load ended, the failed ones among them)."""
        return set(), set()

    def take_reports(self) -> list[TransferReport]:
        """The transfers finished since the last call."""
        return []

    def shutdown(self) -> None:
        pass


class PdserveConnectorBase(KVConnectorBase_V1):
    """vLLM's connector: each call to the half that runs in this process (a subclass sets
    `scheduler` or `worker`, as `role` says)."""

    # What a pdserve connector loads was sent by another worker: vLLM's stats tell these
    # tokens apart from the host KV pool's (pdserve/worker/engine_stats.py counts the pool's).
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        _log_to_stderr()
        self.shape = KvShape.of(vllm_config)
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        self.metadata = PdserveMetadata()  # the step's, on the worker side

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """None of vLLM's: the worker exports each transfer itself (pdserve/worker/engine_stats.py).
        Beside the KV pool's connector in vLLM's MultiConnector, each connector whose stats it
        sees must have some, or vLLM's metrics fail every request."""
        return _NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # Scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.scheduler.metadata(scheduler_output)

    def request_finished(self, request, block_ids):
        self.scheduler.request_finished(request)
        return False, None  # a prefill worker copies its blocks out during the forward pass

    # Worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        self.worker.register_kv_caches(KvCaches.of(kv_caches, self.shape))

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self.metadata = connector_metadata
        self.worker.bind(connector_metadata)

    def clear_connector_metadata(self):
        super().clear_connector_metadata()
        self.metadata = PdserveMetadata()

    def start_load_kv(self, forward_context, **kwargs):
        # KV the step computes from (vLLM calls this before the forward pass when the step has
        # synchronous loads); asynchronous loads happen in get_transfer_results.
        self.worker.load_now(self.metadata)

    def wait_for_layer_load(self, layer_name):
        pass  # start_load_kv queued every layer's load before the forward pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self.worker.save_kv_layer(layer_name, kv_layer, self.metadata)

    def wait_for_save(self):
        self.worker.wait_for_save(self.metadata)

    def get_transfer_results(self, finished_req_ids):
        loaded, failed = self.worker.transfer_results(self.metadata, finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=loaded, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self):
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self):
        if self.worker is None:  # vLLM asks both sides; only the worker side measures
            return None
        reports = self.worker.take_reports()
        return PdserveKvStats(data={TRANSFERS: reports}) if reports else None

    def shutdown(self):
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
