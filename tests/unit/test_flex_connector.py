"""A flex worker's connector composes both roles' halves (pdserve/worker/flex_connector.py): its
worker half gets every field each role's scheduler half sets in a step (seen: the decode half's
abandoned transfers dropped, so a transfer whose request was computed here instead reached the
worker as never held), and every worker call reaches both roles' worker halves."""

from dataclasses import fields

from decode_workers.connector import DecodeScheduler
from kv_transfer.connector_base import PdserveMetadata, SchedulerHalf, WorkerHalf
from kv_transfer.params import ReceiveKv, to_extra_args
from kv_transfer.transfer_report import Failure, TransferReport
from pdserve.worker.flex_connector import FlexConnector, FlexScheduler, FlexWorker
from prefill_workers.connector import PrefillConnector


class FakeHalfScheduler(SchedulerHalf):
    """A role's scheduler half that fills `filled` with one entry per field, named after it."""

    def __init__(self, role: str, filled: list[str]) -> None:
        self.role, self.filled = role, filled

    def metadata(self, scheduler_output) -> PdserveMetadata:
        return PdserveMetadata(**{name: [f"{self.role} {name}"] for name in self.filled})


def test_a_flex_step_carries_every_field_of_each_half():
    """Whichever half fills whichever field (today's split, a new field on one side, both
    halves on one field), the flex worker half gets it."""
    names = [f.name for f in fields(PdserveMetadata)]
    for prefill_fields in ([names[0]], names, []):
        decode_fields = [name for name in names if name not in prefill_fields] + names[:1]
        flex = FlexScheduler(
            FakeHalfScheduler("prefill", prefill_fields),
            FakeHalfScheduler("decode", decode_fields),
        )
        step = flex.metadata("step 7")
        for name in names:
            expected = [f"prefill {name}"] * (name in prefill_fields)
            expected += [f"decode {name}"] * (name in decode_fields)
            assert getattr(step, name) == expected


class FakeRequest:
    """A request whose prefill worker skips the first block, expecting this worker holds it."""

    request_id = "req-1"
    kv_transfer_params = to_extra_args(ReceiveKv("t-9", 5.0, num_tokens=256, skip_tokens=128))[
        "kv_transfer_params"
    ]


def test_a_flex_workers_abandoned_transfer_reaches_its_worker_half():
    """The decode half's plan abandons a transfer (the prefix it skipped is not held here):
    the flex step's metadata carries it, as a decode worker's does."""
    flex = FlexScheduler(SchedulerHalf(), DecodeScheduler(block_size=128))
    assert flex.get_num_new_matched_tokens(FakeRequest(), 0) == (0, False)  # held: none
    assert flex.metadata("step").abandoned == ["t-9"]
    assert flex.metadata("next step").abandoned == []  # told once


class FakeWorkerHalf(WorkerHalf):
    """Records the calls it gets; reports one transfer and one loaded request of its own."""

    def __init__(self, role: str) -> None:
        self.role, self.calls = role, []

    def bind(self, metadata):
        self.calls.append("bind")

    def save_kv_layer(self, layer_name, kv_layer, metadata):
        self.calls.append(f"save {layer_name}")

    def wait_for_save(self, metadata):
        self.calls.append("wait_for_save")

    def transfer_results(self, metadata, finished_req_ids):
        ended = {f"{self.role}-req"}
        return ended, (ended if self.role == "decode" else set())

    def take_reports(self):
        return [TransferReport(f"{self.role}-t", failure=Failure.TIMEOUT)]

    def shutdown(self):
        self.calls.append("shutdown")


def test_every_worker_call_reaches_both_halves_and_their_answers_are_joined():
    prefill, decode = FakeWorkerHalf("prefill"), FakeWorkerHalf("decode")
    flex = FlexWorker(prefill, decode)
    flex.bind(PdserveMetadata())
    flex.save_kv_layer("layers.0", None, PdserveMetadata())
    flex.wait_for_save(PdserveMetadata())
    flex.shutdown()
    assert prefill.calls == decode.calls == ["bind", "save layers.0", "wait_for_save", "shutdown"]
    assert flex.transfer_results(PdserveMetadata(), set()) == (
        {"prefill-req", "decode-req"},
        {"decode-req"},
    )
    assert [r.transfer_id for r in flex.take_reports()] == ["prefill-t", "decode-t"]


def test_a_flex_engine_keeps_attention_out_of_full_cuda_graphs_as_a_prefill_one_does():
    """Its prefill half sends from the save_kv_layer hook, which a full CUDA graph would skip."""
    assert FlexConnector.requires_piecewise_for_cudagraph({}) is True
    assert PrefillConnector.requires_piecewise_for_cudagraph({}) is True
