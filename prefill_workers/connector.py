"""PrefillConnector: the KV producer a prefill worker's vLLM loads by module path.

    kv_transfer_config = {"kv_connector": "PrefillConnector",
                          "kv_connector_module_path": "prefill_workers.connector",
                          "kv_role": "kv_producer"}

Scheduler side: the send plan says which blocks each step computed for requests with `SendKv`
params. Worker side: after each layer's forward, the layer sender pushes those blocks.
"""

from kv_transfer.channels import kv_sender
from kv_transfer.compatibility import compatibility_of
from kv_transfer.connector_base import PdserveConnectorBase, PdserveMetadata
from prefill_workers.kv_sender import LayerSender
from prefill_workers.send_plan import SendPlan


class PrefillConnector(PdserveConnectorBase):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """`save_kv_layer` is a Python hook around each attention op: a full CUDA graph (vLLM
        replays one for batches of 1-token requests, as a fully prefix-cached or last-chunk
        prompt is) would skip it. Piecewise graphs run attention outside the graph."""
        return True

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.layer_sender: LayerSender | None = None  # worker side, once the caches are known
        if self.is_scheduler:
            self.send_plan = SendPlan(self.block_size)
        else:
            self.compatibility = compatibility_of(vllm_config)
            extra = vllm_config.kv_transfer_config
            self.send_buffer_bytes = int(extra.kv_connector_extra_config["send_buffer_bytes"])
            self.advertised_host = extra.get_from_extra_config("advertised_host", "127.0.0.1")
            self.integrity = self.compatibility.integrity

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        self.layer_sender = LayerSender(
            kv_sender(
                self.compatibility,
                self.advertised_host,
                self.kv_caches[0].device,
                self.integrity,
            ),
            self.layout,
            self.head_size,
            self.total_kv_heads,
            self.tp,
            self.worker_rank(),
            self.kv_caches[0].device,
            self.send_buffer_bytes,
        )

    def bind_connector_metadata(self, connector_metadata):
        super().bind_connector_metadata(connector_metadata)
        self.layer_sender.new_step(connector_metadata.sends)

    def build_connector_meta(self, scheduler_output):
        return PdserveMetadata(sends=self.send_plan.sends(scheduler_output))

    def request_finished(self, request, block_ids):
        self.send_plan.forget(request.request_id)
        return super().request_finished(request, block_ids)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        if self.metadata is not None and self.metadata.sends:
            self.layer_sender.save_layer(
                self.layer_index[layer_name], kv_layer, self.metadata.sends
            )

    def wait_for_save(self):
        if self.metadata is not None and self.metadata.sends:
            self.layer_sender.fence()

    def shutdown(self):
        if self.layer_sender is not None:
            self.layer_sender.close()
