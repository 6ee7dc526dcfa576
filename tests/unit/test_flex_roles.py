"""router/workers/flex_roles.py over a real WorkerPool of fake flex workers (tests/fakes.py's,
no engine): the initial split, set_split's choices and refusals, and
AutoRatio's decisions with their hysteresis and rate limit."""

import pytest
from prometheus_client import CollectorRegistry

from router.http.errors import OpenAIError
from router.workers.flex_roles import AutoRatio, AutoRatioSettings, FlexRoles, RoleMetrics
from router.workers.pool import WorkerPool
from tests.fakes import FakeWorker


def flex_worker(name: str, flex: bool = True, role: str = "") -> FakeWorker:
    """A flex worker just joined (no role yet), or a fixed one of `role`."""
    worker = FakeWorker(name, role, flex=flex, address=name)
    worker.identity.max_num_seqs = 4
    return worker


def flex_roles(count: int, fixed: list[FakeWorker] = ()) -> FlexRoles:
    pool = WorkerPool([])
    pool.workers = [flex_worker(f"w{i}") for i in range(count)] + list(fixed)
    roles = FlexRoles(pool, RoleMetrics(CollectorRegistry()))
    roles.place_new()
    return roles


def split(roles: FlexRoles) -> list[str]:
    return [w.role for w in roles.flex()]


@pytest.mark.parametrize(
    "count, expected",
    [(1, ["decode"]), (2, ["prefill", "decode"]), (3, ["prefill", "decode", "decode"])],
)
def test_half_the_flex_workers_start_as_prefill_rounded_down(count, expected):
    assert split(flex_roles(count)) == expected


def test_set_split_moves_the_least_busy_and_counts_it():
    roles = flex_roles(3)
    busy, idle = roles.flex()[1], roles.flex()[2]
    busy.reports(running_requests=3)
    idle.reports(running_requests=0)
    [change] = roles.set_split(2, None, by="manual")
    assert (change.worker_id, change.before, change.after) == (
        idle.identity.worker_id,
        "decode",
        "prefill",
    )
    assert split(roles) == ["prefill", "decode", "prefill"]
    metrics = roles.metrics
    assert metrics.workers.labels("prefill")._value.get() == 2
    assert metrics.changes.labels("prefill", "manual")._value.get() == 1
    assert roles.set_split(None, 1, by="manual") == []  # already so


@pytest.mark.parametrize(
    "prefill, decode, words",
    [
        (3, None, "at least one worker must decode"),
        (-1, None, "prefill (-1) and decode (4)"),
        (2, 2, "at most the 3 flex workers"),
        (None, None, "give prefill or decode"),
    ],
)
def test_impossible_splits_are_refused(prefill, decode, words):
    with pytest.raises(OpenAIError) as caught:
        flex_roles(3).set_split(prefill, decode, by="manual")
    assert caught.value.status == 400 and words in caught.value.message


def test_a_split_of_fewer_workers_puts_the_rest_on_standby_and_back():
    roles = flex_roles(3)
    roles.set_split(1, 1, by="manual")
    assert sorted(split(roles)) == ["decode", "prefill", "standby"]
    assert roles.view()["flex"] == {"prefill": 1, "decode": 1, "standby": 1}
    roles.set_split(2, 1, by="manual")
    assert sorted(split(roles)) == ["decode", "prefill", "prefill"]


def test_with_a_fixed_decode_worker_every_flex_worker_may_prefill():
    roles = flex_roles(2, fixed=[flex_worker("d", flex=False, role="decode")])
    roles.set_split(2, None, by="manual")
    assert split(roles) == ["prefill", "prefill"]


def auto_over(count: int) -> tuple[AutoRatio, FlexRoles]:
    roles = flex_roles(count)
    settings = AutoRatioSettings(patience=2, max_changes_per_minute=2, prefill_backlog_tokens=1000)
    return AutoRatio(roles, settings), roles


def test_a_prefill_backlog_that_holds_moves_a_decode_worker_and_its_end_moves_it_back():
    auto, roles = auto_over(3)
    prefill = roles.flex()[0]
    prefill.reports(outstanding_prefill_tokens=5000)
    assert auto.check(0.0) is None  # patience: once is not enough
    change = auto.check(1.0)
    assert (change.before, change.after) == ("decode", "prefill")
    assert "prefill_backlog_per_worker=5000" in change.reason
    assert split(roles).count("prefill") == 2
    for worker in roles.flex():
        worker.reports()  # the burst is over
    assert auto.check(2.0) is None
    back = auto.check(3.0)
    assert (back.before, back.after) == ("prefill", "decode")
    assert split(roles).count("prefill") == 1


def test_a_full_decode_pool_takes_an_idle_prefill_worker_but_leaves_none_to_prefill_alone():
    auto, roles = auto_over(2)
    decode = [w for w in roles.flex() if w.role == "decode"][0]
    decode.reports(running_requests=4, waiting_requests=2)
    assert auto.check(0.0) is None
    change = auto.check(1.0)
    assert change.after == "decode" and split(roles) == ["decode", "decode"]


def test_at_most_max_changes_per_minute():
    auto, roles = auto_over(8)
    moved_at = []
    for second in range(70):
        for worker in roles.flex():
            worker.reports(outstanding_prefill_tokens=5000 if worker.role == "prefill" else 0)
        if auto.check(float(second)) is not None:
            moved_at.append(second)
    assert len(moved_at) == 3 and moved_at[2] - moved_at[0] >= 60, moved_at


def test_a_replaced_flex_worker_comes_back_in_the_role_its_predecessor_held():
    roles = flex_roles(4)  # 2 prefill, 2 decode
    roles.set_split(3, None, by="manual")
    pool = roles.pool
    lost = next(w for w in roles.flex() if w.role == "prefill")
    pool.workers.remove(lost)  # it died and left the pools
    pool.workers.append(flex_worker("w-replacement"))  # the keeper's replacement joins
    roles.place_new()
    assert sorted(split(roles)) == ["decode", "prefill", "prefill", "prefill"]
    pool.workers.append(flex_worker("w-new"))  # no role lacks one: the initial split's
    roles.place_new()
    assert split(roles)[-1] == "decode"
