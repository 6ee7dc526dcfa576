"""The router addresses a data-parallel rank: a worker whose engine runs several ranks (a
wide-EP group's node) gets each request on its idlest rank, and a disaggregated request's prefill
leg carries the decode rank, whose KV receivers follow the rank before's (as vLLM's
NixlConnector offsets its side channel by the DP index). Fake workers (tests/fakes.py) and a
fake engine stand in for vLLM, which runs no data parallelism on CPU."""

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from kv_transfer.params import SendKv, from_request
from pdserve.core.kinds import Role
from pdserve.protocol import worker_pb2
from pdserve.protocol.data_parallel import data_parallel_kv_address, kv_rank_offset, kv_receivers
from pdserve.worker.engine_stats import EngineStats
from pdserve.worker.service import State, WorkerService, kv_extra_args
from router.workers.data_parallel import on_rank, pick_rank
from tests.fakes import FakeWorker, answering, router_over
from tests.unit.test_request_flow import disaggregated, new_request, start


def test_the_idlest_rank_takes_a_request_and_a_burst_spreads_over_the_ranks():
    worker = FakeWorker("decode-a", data_parallel_ranks=4)
    worker.reports(data_parallel_running=[3, 1, 2, 0])
    assert [pick_rank(worker) for _ in range(7)] == [3, 1, 3, 1, 2, 3, 0]
    worker.reports(data_parallel_running=[0, 4, 4, 4])  # a new report replaces what was sent
    assert pick_rank(worker) == 0 and worker.load.rank_requests(0) == 1


def test_a_worker_of_one_rank_gets_the_request_as_it_is():
    _, request = new_request()
    assert on_rank(FakeWorker("decode-a"), request) is request
    addressed = on_rank(FakeWorker("decode-b", data_parallel_ranks=2), request)
    assert addressed.data_parallel_rank == 0 and not request.HasField("data_parallel_rank")


def test_the_local_path_names_the_decode_workers_rank():
    decode = answering("decode-a")
    decode.identity.data_parallel_ranks = 2
    decode.reports(data_parallel_running=[7, 2])
    run, request = new_request()
    start(router_over(decode), run, request)
    assert [r.data_parallel_rank for r in decode.requests] == [1]


def test_the_prefill_leg_sends_the_kv_to_the_rank_that_decodes():
    prefill = answering("prefill-a", Role.PREFILL)
    prefill.identity.data_parallel_ranks = 2
    prefill.reports(data_parallel_running=[1, 0])
    decode = answering("decode-a")
    decode.identity.data_parallel_ranks = 4
    decode.identity.tensor_parallel_size = 2
    decode.reports(data_parallel_running=[5, 5, 0, 5])
    disaggregated(router_over(prefill, decode), list(range(40)), "cmpl-dp")
    (prefill_leg,), (decode_leg,) = prefill.requests, decode.requests
    assert (prefill_leg.data_parallel_rank, decode_leg.data_parallel_rank) == (1, 2)
    assert prefill_leg.kv.peer_data_parallel_rank == 2
    assert prefill_leg.kv.send_to == decode.identity.kv_address == "decode-a:6000"
    assert prefill_leg.kv.peer_tensor_parallel_size == 2
    # Its connector pushes to decode rank 2's receivers: port + 2 x TP 2 (+ r for TP rank r).
    params = from_request(kv_extra_args(prefill_leg)["kv_transfer_params"])
    assert params == SendKv("cmpl-dp", "decode-a:6000", 2, "grpc", 0, 2)
    assert params.receivers == "decode-a:6004"


def test_data_parallel_ranks_receive_kv_on_consecutive_port_ranges():
    assert [kv_rank_offset(d, 2, r) for d in range(3) for r in range(2)] == [0, 1, 2, 3, 4, 5]
    assert kv_receivers(8, 1) == 8 and kv_receivers(0, 4) == 4
    assert data_parallel_kv_address("10.0.0.5:50100", 3, 1) == "10.0.0.5:50103"
    assert SendKv("t", "h:100", 4).receivers == "h:100"  # one rank: the worker's own port


def test_a_decode_rank_binds_the_receiver_of_its_engines_local_rank():
    from decode_workers.connector import data_parallel_index

    engine = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank_local=5))
    plain = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank_local=None))
    assert (data_parallel_index(engine), data_parallel_index(plain)) == (5, 0)


class RankEngine:
    """Stands in for vLLM's AsyncLLM: one token per request, on the rank it was named, while
    the test looks at the worker's counts."""

    def __init__(self) -> None:
        self.ranks: list[int | None] = []
        self.seen_running: list[list[int]] = []
        self.service: WorkerService | None = None

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def generate(
        self, prompt, sampling, request_id, trace_headers=None, data_parallel_rank=None
    ):
        self.ranks.append(data_parallel_rank)
        self.seen_running.append(list(self.service.rank_running))
        yield SimpleNamespace(
            request_id=request_id,
            finished=True,
            prompt_token_ids=prompt["prompt_token_ids"],
            num_cached_tokens=0,
            prompt_logprobs=None,
            metrics=None,
            outputs=[
                SimpleNamespace(
                    token_ids=[7],
                    text="x",
                    finish_reason="length",
                    stop_reason=None,
                    logprobs=None,
                    cumulative_logprob=None,
                )
            ],
        )


class Context:
    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise grpc.RpcError(code, details)


def test_the_worker_runs_a_request_on_its_named_rank_and_counts_each_ranks_load():
    service = WorkerService("decode-a", "decode", "m")
    engine = RankEngine()
    engine.service, service.engine, service.state = service, engine, State.READY
    service.identity.max_model_len, service.rank_running = 64, [0, 0, 0]
    sampling = worker_pb2.SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0)

    async def run(**fields):
        request = worker_pb2.GenerateRequest(
            request_id="r", prompt_token_ids=[1, 2], sampling=sampling, **fields
        )
        return [chunk async for chunk in service.Generate(request, Context())]

    asyncio.run(run(data_parallel_rank=2))
    asyncio.run(run())  # unnamed: the engine balances
    assert engine.ranks == [2, None] and engine.seen_running == [[0, 0, 1], [0, 0, 0]]
    assert service.rank_running == [0, 0, 0]
    assert list(service.stats_reply().data_parallel_running) == [0, 0, 0]
    with pytest.raises(grpc.RpcError) as refused:
        asyncio.run(run(data_parallel_rank=3))
    assert refused.value.args == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "data_parallel_rank 3: this worker runs 3",
    )
    single = WorkerService("decode-b", "decode", "m")
    assert not single.stats_reply().data_parallel_running  # one rank: nothing per rank


def test_a_data_parallel_workers_engine_figures_are_its_ranks_together():
    stats = EngineStats()
    stats.update(4, 1, 0.5, engine=8)  # engine indexes are the group's DP ranks
    stats.update(2, 0, 0.1, engine=9)
    stats.update(3, 2, 0.3, engine=8)
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (5, 2, pytest.approx(0.2))
