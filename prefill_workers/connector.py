"""PrefillConnector: the KV producer a prefill worker's vLLM loads by module path.

    kv_transfer_config = {"kv_connector": "PrefillConnector",
                          "kv_connector_module_path": "prefill_workers.connector",
                          "kv_role": "kv_producer"}

Scheduler half: the send plan says which blocks each step computed for requests with `SendKv`
params. Worker half: after each layer's forward, the layer sender pushes those blocks.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kv_transfer.channels import kv_sender
from kv_transfer.compatibility import compatibility_of
from kv_transfer.connector_base import (
    KvCaches,
    KvShape,
    PdserveConnectorBase,
    PdserveMetadata,
    SchedulerHalf,
    WorkerHalf,
    tensor_parallel_rank,
)
from prefill_workers.kv_sender import LayerSender
from prefill_workers.send_plan import SendPlan


class PrefillScheduler(SchedulerHalf):
    def __init__(self, block_size: int) -> None:
        self.send_plan = SendPlan(block_size)

    def metadata(self, scheduler_output) -> PdserveMetadata:
        return PdserveMetadata(sends=self.send_plan.sends(scheduler_output))

    def request_finished(self, request) -> None:
        self.send_plan.forget(request.request_id)


class PrefillWorker(WorkerHalf):
    def __init__(self, vllm_config, shape: KvShape) -> None:
        self.shape = shape
        self.compatibility = compatibility_of(vllm_config)
        extra = vllm_config.kv_transfer_config
        self.send_buffer_bytes = int(extra.kv_connector_extra_config["send_buffer_bytes"])
        self.advertised_host = extra.get_from_extra_config("advertised_host", "127.0.0.1")
        self.caches: KvCaches | None = None  # once vLLM registers them
        self.layer_sender: LayerSender | None = None  # ... and sends from them

    def register_kv_caches(self, caches: KvCaches) -> None:
        self.caches = caches
        self.layer_sender = LayerSender(
            kv_sender(
                self.compatibility,
                self.advertised_host,
                caches.device,
                self.compatibility.integrity,
            ),
            caches.layout,
            self.shape.head_size,
            self.shape.total_kv_heads,
            self.shape.tp,
            tensor_parallel_rank(),
            caches.device,
            self.send_buffer_bytes,
        )

    def bind(self, metadata: PdserveMetadata) -> None:
        self.layer_sender.new_step(metadata.sends)

    def save_kv_layer(self, layer_name: str, kv_layer, metadata: PdserveMetadata) -> None:
        """Sends from the layer's registered cache, whose layout was found, not `kv_layer`: the
        same memory, but vLLM passes it as the attention layer binds it (an MLA layer's
        [blocks, block_size, latent], its one head squeezed out)."""
        if metadata.sends:
            layer = self.caches.index[layer_name]
            self.layer_sender.save_layer(layer, self.caches.layers[layer], metadata.sends)

    def wait_for_save(self, metadata: PdserveMetadata) -> None:
        if metadata.sends:
            self.layer_sender.fence()

    def shutdown(self) -> None:
        if self.layer_sender is not None:
            self.layer_sender.close()


class PrefillConnector(PdserveConnectorBase):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """`save_kv_layer` is a Python hook around each attention op: a full CUDA graph (vLLM
        replays one for batches of 1-token requests, as a fully prefix-cached or last-chunk
        prompt is) would skip it. Piecewise graphs run attention outside the graph."""
        return True

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.scheduler = (
            PrefillScheduler(self.shape.block_size) if role == KVConnectorRole.SCHEDULER else None
        )
        self.worker = (
            PrefillWorker(vllm_config, self.shape) if role == KVConnectorRole.WORKER else None
        )
