"""KV transfer failures at a decode worker whose policy is `fail`: KV that never comes, a
mismatched pair, a sender without the cluster's secret. Never a hang, never a leaked block.
(Prefill workers killed while their KV is in flight, and requests aborted at every stage, on
every transport: test_kv_transports.py.)"""

import time
from dataclasses import replace

import grpc
import pytest
import torch

from kv_transfer.channels import kv_sender
from kv_transfer.compatibility import Compatibility
from kv_transfer.host_staging import Staged
from kv_transfer.kv_layout import WIRE_LAYOUT
from kv_transfer.transport import TRANSPORTS, LayerSlice
from pdserve.cluster.local_workers import start_worker, stop_worker, wait_ready
from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings.cluster_secret import SECRET_ENV, secret_metadata
from pdserve.settings.engine import EngineSettings
from pdserve.settings.worker import WorkerSettings
from tests.integration.conftest import KV_CACHE_GIB
from tests.integration.prompts import DISAGGREGATED_MAX_TOKENS, DISAGGREGATED_PROMPTS
from tests.waiting import wait_for

CONSUMER = Compatibility(
    model="smollm2",
    dtype="float32",
    block_size=128,
    num_layers=30,
    total_kv_heads=3,
    head_size=64,
    kv_layout=WIRE_LAYOUT,
    vllm_version="0.32.0",
    bytes_per_head_token=512,  # K and V, 64 float32 each
    kv_scale_mode="none",
)


@pytest.fixture(scope="module")
def fail_policy_decoder(smollm2_dir, tmp_path_factory):
    """A decode worker whose policy is `fail`, with no prefill worker anywhere."""
    settings = WorkerSettings(
        role="decode",
        port=0,
        kv_failure_policy="fail",
        engine=EngineSettings(dtype="float32", kv_cache_gib=float(KV_CACHE_GIB)),
    )
    worker = start_worker(settings, tmp_path_factory.mktemp("fail-decoder"), threads=1)
    try:
        wait_ready([worker], timeout_s=600, progress=lambda _: None)
        yield worker
    finally:
        stop_worker(worker)


def waiting_request(model_dir, request_id: str, transfer_id: str, timeout_s: float):
    """A decode request whose prompt's KV is to come from a prefill worker (none is told)."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model_dir).encode(DISAGGREGATED_PROMPTS[4])
    return worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=worker_pb2.SamplingParams(max_tokens=4, temperature=0, top_p=1),
        kv=worker_pb2.KvTransfer(transfer_id=transfer_id, receive_timeout_s=timeout_s),
    )


INTRUDER_WAIT_S = 10.0  # the KV deadline of the requests an intruder pushes KV for


def waiting_for_kv(stub, count: int) -> None:
    """Until the decode worker's engine holds `count` requests (its Stats after an engine step,
    which has put them in its KV receiver's wait)."""
    wait_for(
        lambda: (
            stub.Stats(
                worker_pb2.StatsRequest(fresh=True), timeout=30, metadata=secret_metadata()
            ).running_requests
            == count
        ),
        30,
        f"{count} request(s) waiting for their KV on the decode worker",
    )


def test_kv_that_never_comes_fails_within_the_deadline_and_frees_its_blocks(
    fail_policy_decoder, smollm2_dir
):
    request = waiting_request(smollm2_dir, "orphan", "never-sent", timeout_s=2.0)
    with grpc.insecure_channel(fail_policy_decoder.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=30, metadata=secret_metadata()))
        assert time.monotonic() - started < 10
        assert caught.value.code() == grpc.StatusCode.ABORTED
        assert "did not arrive within 2 s" in caught.value.details()
        assert "'fail'" in caught.value.details()
        stats = stub.Stats(
            worker_pb2.StatsRequest(fresh=True), timeout=30, metadata=secret_metadata()
        )
    assert (stats.running_requests, stats.kv_blocks_used) == (0, 0)


def test_told_it_holds_a_prefix_it_lacks_a_decode_worker_computes_the_prompt_at_once(
    fail_policy_decoder, smollm2_dir, offline_reference
):
    """The router may think a decode worker holds a prefix it has evicted: told that the first
    256 prompt tokens are held and will not be sent, a worker holding none computes the prompt
    itself, at once (not at the KV deadline, and with the `fail` policy too), answers as vLLM
    does, reports the transfer failed as `not_held` (the router then forgets its estimate), and
    keeps no block."""
    request = waiting_request(smollm2_dir, "not-held", "skipped-but-lacking", timeout_s=60.0)
    request.kv.skip_tokens = 256
    request.sampling.max_tokens = DISAGGREGATED_MAX_TOKENS
    assert len(request.prompt_token_ids) > 256
    with grpc.insecure_channel(fail_policy_decoder.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        started = time.monotonic()
        chunks = list(stub.Generate(request, timeout=60, metadata=secret_metadata()))
        assert time.monotonic() - started < 30
        assert "".join(c.text for c in chunks) == offline_reference["disaggregated"][4]["text"]
        assert (chunks[-1].kv.failed, chunks[-1].kv.failure) == (True, "not_held")
        stats = stub.Stats(
            worker_pb2.StatsRequest(fresh=True), timeout=30, metadata=secret_metadata()
        )
    assert (stats.running_requests, stats.kv_blocks_used) == (0, 0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_refused_handshake_fails_the_waiting_request_at_once_not_at_the_deadline(
    fail_policy_decoder, smollm2_dir, transport
):
    """A prefill worker whose KV means something else (bfloat16 against this float32 worker)
    is refused, on every transport, and cancels what it was sending: the decode worker's policy
    applies within a second or two, not after the 30 s KV timeout."""
    transfer_id = f"from-a-bf16-prefill-{transport}"
    request = waiting_request(smollm2_dir, f"refused-{transport}", transfer_id, timeout_s=30.0)
    with grpc.insecure_channel(fail_policy_decoder.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        kv_address = stub.Health(
            worker_pb2.HealthRequest(), timeout=10, metadata=secret_metadata()
        ).kv_address
        call = stub.Generate(request, timeout=60, metadata=secret_metadata())
        waiting_for_kv(stub, 1)
        sender = kv_sender(replace(CONSUMER, dtype="bfloat16"), "127.0.0.1", torch.device("cpu"))
        payload = torch.zeros(8, dtype=torch.uint8)
        piece = LayerSlice(transfer_id, 0, 0, 1, 0, 3, Staged(payload, 8), True)
        started = time.monotonic()
        sender.send(kv_address, transport, piece)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        waited = time.monotonic() - started
        sender.close()
    assert caught.value.code() == grpc.StatusCode.ABORTED
    print(f"a refused handshake failed the waiting request in {waited:.2f} s")
    assert waited < 2, f"the refusal took {waited:.1f} s to fail the request"
    assert fail_policy_decoder.log_path.read_text().count("dtype: producer 'bfloat16'") >= 1


def test_without_the_cluster_secret_no_call_is_served_and_no_kv_is_written(
    fail_policy_decoder, smollm2_dir, monkeypatch
):
    """A process that reaches the worker's ports but lacks the cluster's secret: its gRPC calls
    are refused, and KV it pushes for a waiting request is refused before it is written (the
    request fails at its deadline instead, as if nothing had come), on every transport."""
    with grpc.insecure_channel(fail_policy_decoder.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        unknown = waiting_request(smollm2_dir, "x", "y", 1)
        for call in (
            lambda metadata: stub.Health(worker_pb2.HealthRequest(), timeout=10, metadata=metadata),
            lambda metadata: list(stub.Generate(unknown, timeout=10, metadata=metadata)),
        ):
            for metadata in ((), (("x-pdserve-cluster-secret", "a guess"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    call(metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        kv_address = stub.Health(
            worker_pb2.HealthRequest(), timeout=10, metadata=secret_metadata()
        ).kv_address
        transfer_ids = [f"intruder-{transport}" for transport in TRANSPORTS]
        calls = [
            stub.Generate(
                # Long enough for all three to be waiting before the intruder sends (seen: a
                # 3 s deadline passed on a loaded machine before the third was admitted).
                waiting_request(smollm2_dir, transfer_id, transfer_id, timeout_s=INTRUDER_WAIT_S),
                timeout=60,
                metadata=secret_metadata(),
            )
            for transfer_id in transfer_ids
        ]
        waiting_for_kv(stub, len(calls))
        monkeypatch.setenv(SECRET_ENV, "not this cluster's")  # what the intruder's hello carries
        intruder = kv_sender(CONSUMER, "127.0.0.1", torch.device("cpu"))
        for transfer_id, transport in zip(transfer_ids, TRANSPORTS, strict=True):
            payload = torch.zeros(8, dtype=torch.uint8)
            intruder.send(
                kv_address,
                transport,
                LayerSlice(transfer_id, 0, 0, 1, 0, 3, Staged(payload, 8), True),
            )
        for call in calls:
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.ABORTED
            assert f"did not arrive within {INTRUDER_WAIT_S:g} s" in caught.value.details()
        intruder.close()
    log = fail_policy_decoder.log_path.read_text()
    # The refused calls and the refused hellos, each kind logged once every 10 s at the most
    # (kv_transfer/log_limit.py: an intruder cannot flood the log)
    assert "call without this cluster's secret: refused" in log
    assert "the KV stream did not carry this cluster's secret" in log
