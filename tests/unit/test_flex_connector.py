"""A flex worker's connector gives its worker half what both role halves' scheduler halves say
in a step (pdserve/worker/flex_connector.py): the prefill half's sends, the decode half's
expected and abandoned transfers (seen: the abandoned ones dropped, so a transfer whose request
was computed here instead reached the worker as never held)."""

from types import SimpleNamespace


class FakeSendPlan:
    def sends(self, scheduler_output):
        return [f"send of {scheduler_output}"]


class FakeLoadPlan:
    def take_expected(self):
        return ["expected"]

    def take_abandoned(self):
        return ["abandoned"]


def halves() -> SimpleNamespace:
    """The plans of both halves, as a flex connector holds them (fakes)."""
    return SimpleNamespace(send_plan=FakeSendPlan(), load_plan=FakeLoadPlan())


def test_a_flex_step_carries_every_field_of_each_half():
    from decode_workers.connector import DecodeConnector
    from pdserve.worker.flex_connector import FlexConnector
    from prefill_workers.connector import PrefillConnector

    flex = FlexConnector.build_connector_meta(halves(), "step 7")
    assert flex.sends == ["send of step 7"]
    assert flex.expected == ["expected"] and flex.abandoned == ["abandoned"]
    prefill = PrefillConnector.build_connector_meta(halves(), "step 7")
    decode = DecodeConnector.build_connector_meta(halves(), "step 7")
    for field in ("sends", "expected", "abandoned"):  # whatever either half sets, flex does
        assert getattr(flex, field) == (getattr(prefill, field) or getattr(decode, field))
