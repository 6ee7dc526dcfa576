"""DecodeConnector: the KV consumer a decode worker's vLLM loads by module path.

    kv_transfer_config = {"kv_connector": "DecodeConnector",
                          "kv_connector_module_path": "decode_workers.connector",
                          "kv_role": "kv_consumer",
                          "kv_load_failure_policy": "recompute" | "fail",
                          "kv_connector_extra_config": {"receiver_host": ..., "receiver_port": ...,
                                                        "advertised_host": ...,
                                                        "integrity": true}}

Scheduler half: the load plan admits requests with `ReceiveKv` params and reserves their
blocks: loading in the step that schedules them when every rank holds their KV already (the
ranks' arrival notices say so: decode_workers/arrivals.py), asynchronously otherwise. Worker
half: the KV receiver takes KV from every transport (rank r listens on receiver_port + r;
data-parallel rank d's on + d x TP + r: pdserve/protocol/data_parallel.py;
kv_transfer/kv_receiver.py), and the KV loader copies it into the reserved blocks: before
the forward pass for a load in the request's step (blocks it could not fill are load errors),
else reporting each transfer loaded or failed; vLLM applies `kv_load_failure_policy` to
failures.
"""

import logging
import sys

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from decode_workers.arrivals import ArrivalBoard, ArrivalNotices, arrivals_address
from decode_workers.kv_loader import KvLoader
from decode_workers.load_plan import LoadPlan, never
from kv_transfer.compatibility import compatibility_of, integrity_of, max_slice_bytes
from kv_transfer.connector_base import (
    KvCaches,
    KvShape,
    PdserveConnectorBase,
    PdserveMetadata,
    SchedulerHalf,
    WorkerHalf,
    tensor_parallel_rank,
)
from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.params import ReceiveKv
from kv_transfer.transfer_report import TransferReport
from pdserve.protocol.data_parallel import kv_rank_offset

log = logging.getLogger("pdserve.kv")
# vLLM's worker loop spins in Python while a request waits for KV; with the default 5 ms GIL
# switch interval each KV message waited up to 5 ms for the GIL there (0.45 s for 30 layers).
GIL_SWITCH_INTERVAL_S = 0.0002


class DecodeScheduler(SchedulerHalf):
    def __init__(self, block_size: int, arrivals: ArrivalBoard | None = None) -> None:
        """`arrivals`: what the ranks announced (none: every load asynchronous)."""
        self.arrivals = arrivals
        self.load_plan = LoadPlan(block_size, self._arrived if arrivals else never)

    @classmethod
    def of(cls, vllm_config, shape: KvShape) -> "DecodeScheduler":
        address = engine_arrivals_address(vllm_config)
        return cls(shape.block_size, ArrivalBoard(address, shape.tp, shape.total_kv_heads))

    def _arrived(self, params: ReceiveKv) -> bool:
        return self.arrivals.arrived(params.transfer_id, params.prefill_tp)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.load_plan.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.load_plan.update_state_after_alloc(request, blocks, num_external_tokens)

    def metadata(self, scheduler_output) -> PdserveMetadata:
        return PdserveMetadata(
            expected=self.load_plan.take_expected(),
            loads=self.load_plan.take_loads(),
            abandoned=self.load_plan.take_abandoned(),
        )

    def request_finished(self, request) -> None:
        self.load_plan.forget(request.request_id)

    def shutdown(self) -> None:
        if self.arrivals is not None:
            self.arrivals.close()


def data_parallel_index(vllm_config) -> int:
    """This engine's data-parallel rank among the worker's own (0 without data parallelism):
    vLLM sets it in each of a data-parallel worker's engine processes, MoE or not."""
    return vllm_config.parallel_config.data_parallel_rank_local or 0


def engine_arrivals_address(vllm_config) -> str:
    """Where this engine's ranks tell its scheduler half of KV that arrived: both processes
    read it from the same vLLM config (vLLM draws the KV engine id once per engine)."""
    return arrivals_address(
        vllm_config.kv_transfer_config.engine_id, data_parallel_index(vllm_config)
    )


class DecodeWorker(WorkerHalf):
    """The KV receiver listens from the start; the loader comes once the caches are known."""

    def __init__(self, vllm_config, shape: KvShape) -> None:
        transfer = vllm_config.kv_transfer_config
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.shape = shape
        self.rank = tensor_parallel_rank()
        self.integrity = integrity_of(vllm_config)
        compatibility = compatibility_of(vllm_config)
        self.receiver = KvReceiver(
            compatibility,
            integrity=self.integrity,
            max_slice_bytes=max_slice_bytes(compatibility, vllm_config.model_config.max_model_len),
        )
        host = transfer.get_from_extra_config("receiver_host", "127.0.0.1")
        port = int(transfer.get_from_extra_config("receiver_port", 0))
        advertised = transfer.get_from_extra_config("advertised_host", host)
        offset = kv_rank_offset(data_parallel_index(vllm_config), shape.tp, self.rank)
        bound = self.receiver.start(host, port + offset if port else 0, advertised)
        log.info("KV receiver (rank %d) listening on %s:%d", self.rank, host, bound)
        self.notices = ArrivalNotices(
            engine_arrivals_address(vllm_config),
            self.rank,
            compatibility.num_layers,
            integrity=self.integrity,
        )
        self.receiver.inbox.landed = self.notices.landed
        self.loader: KvLoader | None = None

    def register_kv_caches(self, caches: KvCaches) -> None:
        self.receiver.device = caches.device  # where nccl receives
        self.loader = KvLoader(
            self.receiver,
            caches.layers,
            caches.layout,
            self.shape.head_size,
            self.shape.total_kv_heads,
            self.shape.tp,
            self.rank,
            integrity=self.integrity,
        )
        # Slices land in pinned memory beside CUDA: their copies never block vLLM's thread.
        self.receiver.inbox.new_buffer = self.loader.staging.receive_buffer

    def transfer_results(
        self, metadata: PdserveMetadata, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str]]:
        self.loader.abandon(metadata.abandoned)
        return self.loader.transfer_results(metadata.expected, finished_req_ids)

    def load_now(self, metadata: PdserveMetadata) -> None:
        self.loader.load_now(metadata.loads)

    def take_load_errors(self) -> set[int]:
        return self.loader.take_load_errors()

    def take_reports(self) -> list[TransferReport]:
        return self.loader.take_reports()

    def shutdown(self) -> None:
        self.receiver.stop()
        self.notices.close()


class DecodeConnector(PdserveConnectorBase):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.scheduler = (
            DecodeScheduler.of(vllm_config, self.shape)
            if role == KVConnectorRole.SCHEDULER
            else None
        )
        self.worker = (
            DecodeWorker(vllm_config, self.shape) if role == KVConnectorRole.WORKER else None
        )
