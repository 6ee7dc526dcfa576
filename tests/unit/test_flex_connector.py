"""A flex worker's connector composes both roles' halves (pdserve/worker/flex_connector.py): its
worker half gets every field each role's scheduler half sets in a step (seen: the decode half's
abandoned transfers dropped, so a transfer whose request was computed here instead reached the
worker as never held), and every worker call reaches both roles' worker halves."""

from dataclasses import fields

import pytest

from kv_transfer.params import ReceiveKv, to_extra_args
from kv_transfer.transfer_report import Failure, TransferReport


@pytest.fixture(scope="module")
def flex():
    """The connector modules, imported here: they import vLLM (~4 s of a core), which the
    process running these tests pays, not every test process's collection."""
    from pdserve.worker import flex_connector

    return flex_connector


class FakeHalfScheduler:
    """A role's scheduler half that fills `filled` with one entry per field, named after it."""

    def __init__(self, metadata_class, role: str, filled: list[str]) -> None:
        self.metadata_class, self.role, self.filled = metadata_class, role, filled

    def metadata(self, scheduler_output):
        return self.metadata_class(**{name: [f"{self.role} {name}"] for name in self.filled})


def test_a_flex_step_carries_every_field_of_each_half(flex):
    """Whichever half fills whichever field (today's split, a new field on one side, both
    halves on one field), the flex worker half gets it."""
    PdserveMetadata = flex.PdserveMetadata
    names = [f.name for f in fields(PdserveMetadata)]
    for prefill_fields in ([names[0]], names, []):
        decode_fields = [name for name in names if name not in prefill_fields] + names[:1]
        scheduler = flex.FlexScheduler(
            FakeHalfScheduler(PdserveMetadata, "prefill", prefill_fields),
            FakeHalfScheduler(PdserveMetadata, "decode", decode_fields),
        )
        step = scheduler.metadata("step 7")
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


def test_a_flex_workers_abandoned_transfer_reaches_its_worker_half(flex):
    """The decode half's plan abandons a transfer (the prefix it skipped is not held here):
    the flex step's metadata carries it, as a decode worker's does."""
    scheduler = flex.FlexScheduler(flex.SchedulerHalf(), flex.DecodeScheduler(block_size=128))
    assert scheduler.get_num_new_matched_tokens(FakeRequest(), 0) == (0, False)  # held: none
    assert scheduler.metadata("step").abandoned == ["t-9"]
    assert scheduler.metadata("next step").abandoned == []  # told once


class FakeWorkerHalf:
    """Records the calls it gets; reports one transfer and one loaded request of its own."""

    def __init__(self, role: str) -> None:
        self.role, self.calls = role, []

    def bind(self, metadata):
        self.calls.append("bind")

    def load_now(self, metadata):
        self.calls.append("load_now")

    def take_load_errors(self):
        return {1} if self.role == "prefill" else {2, 3}

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


def test_every_worker_call_reaches_both_halves_and_their_answers_are_joined(flex):
    prefill, decode = FakeWorkerHalf("prefill"), FakeWorkerHalf("decode")
    worker = flex.FlexWorker(prefill, decode)
    worker.bind(flex.PdserveMetadata())
    worker.load_now(flex.PdserveMetadata())
    worker.save_kv_layer("layers.0", None, flex.PdserveMetadata())
    worker.wait_for_save(flex.PdserveMetadata())
    worker.shutdown()
    calls = ["bind", "load_now", "save layers.0", "wait_for_save", "shutdown"]
    assert prefill.calls == decode.calls == calls
    assert worker.take_load_errors() == {1, 2, 3}
    assert worker.transfer_results(flex.PdserveMetadata(), set()) == (
        {"prefill-req", "decode-req"},
        {"decode-req"},
    )
    assert [r.transfer_id for r in worker.take_reports()] == ["prefill-t", "decode-t"]


def test_a_flex_engine_keeps_attention_out_of_full_cuda_graphs_as_a_prefill_one_does(flex):
    """Its prefill half sends from the save_kv_layer hook, which a full CUDA graph would skip."""
    assert flex.FlexConnector.requires_piecewise_for_cudagraph({}) is True
    assert flex.PrefillConnector.requires_piecewise_for_cudagraph({}) is True
