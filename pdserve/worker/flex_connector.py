"""FlexConnector: both KV directions in one engine, for a worker that can play either role.

    kv_transfer_config = {"kv_connector": "FlexConnector",
                          "kv_connector_module_path": "pdserve.worker.flex_connector",
                          "kv_role": "kv_both", ...both halves' extra config...}

It holds the prefill role's half (prefill_workers/) and the decode role's (decode_workers/) for
its process: each request's own params say what it does (`SendKv`: push its prompt's KV;
`ReceiveKv`: wait for it; neither: a plain request), so the worker's role is only which legs the
router sends it, and changing it needs no engine restart. The KV receiver listens from the start.
"""

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from decode_workers.connector import DecodeScheduler, DecodeWorker
from kv_transfer.connector_base import (
    KvCaches,
    PdserveConnectorBase,
    PdserveMetadata,
    SchedulerHalf,
    WorkerHalf,
)
from kv_transfer.transfer_report import TransferReport
from prefill_workers.connector import PrefillConnector, PrefillScheduler, PrefillWorker


class FlexScheduler(SchedulerHalf):
    """Every call to both roles' scheduler halves, their answers joined."""

    def __init__(self, prefill: SchedulerHalf, decode: SchedulerHalf) -> None:
        self.halves = (prefill, decode)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """The half that loads the request's KV answers (at most one does: its params are
        either `SendKv` or `ReceiveKv`)."""
        answers = [h.get_num_new_matched_tokens(request, num_computed_tokens) for h in self.halves]
        return max(answers)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        for half in self.halves:
            half.update_state_after_alloc(request, blocks, num_external_tokens)

    def metadata(self, scheduler_output) -> PdserveMetadata:
        return PdserveMetadata.merge(*(h.metadata(scheduler_output) for h in self.halves))

    def request_finished(self, request) -> None:
        for half in self.halves:
            half.request_finished(request)

    def shutdown(self) -> None:
        for half in self.halves:
            half.shutdown()


class FlexWorker(WorkerHalf):
    """Every call to both roles' worker halves, their answers joined."""

    def __init__(self, prefill: WorkerHalf, decode: WorkerHalf) -> None:
        self.halves = (prefill, decode)

    def register_kv_caches(self, caches: KvCaches) -> None:
        for half in self.halves:
            half.register_kv_caches(caches)

    def bind(self, metadata: PdserveMetadata) -> None:
        for half in self.halves:
            half.bind(metadata)

    def load_now(self, metadata: PdserveMetadata) -> None:
        for half in self.halves:
            half.load_now(metadata)

    def take_load_errors(self) -> set[int]:
        return {block for half in self.halves for block in half.take_load_errors()}

    def save_kv_layer(self, layer_name: str, kv_layer, metadata: PdserveMetadata) -> None:
        for half in self.halves:
            half.save_kv_layer(layer_name, kv_layer, metadata)

    def wait_for_save(self, metadata: PdserveMetadata) -> None:
        for half in self.halves:
            half.wait_for_save(metadata)

    def transfer_results(
        self, metadata: PdserveMetadata, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str]]:
        done, failed = set(), set()
        for half in self.halves:
            half_done, half_failed = half.transfer_results(metadata, finished_req_ids)
            done |= half_done
            failed |= half_failed
        return done, failed

    def take_reports(self) -> list[TransferReport]:
        return [report for half in self.halves for report in half.take_reports()]

    def shutdown(self) -> None:
        for half in self.halves:
            half.shutdown()


class FlexConnector(PdserveConnectorBase):
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """As a prefill worker's: the prefill half sends from the `save_kv_layer` hook."""
        return PrefillConnector.requires_piecewise_for_cudagraph(extra_config)

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        shape = self.shape
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = FlexScheduler(
                PrefillScheduler(shape.block_size), DecodeScheduler.of(vllm_config, shape)
            )
        if role == KVConnectorRole.WORKER:
            self.worker = FlexWorker(
                PrefillWorker(vllm_config, shape), DecodeWorker(vllm_config, shape)
            )
