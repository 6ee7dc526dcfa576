"""Roles of flex workers: which pool (prefill or decode) each one serves, changed live.

A flex worker's engine carries both connector halves (pdserve/worker/flex_connector.py), so its
role is
only which legs this router sends it. A change takes effect for the next request; what the
worker already runs it finishes (a new prefill worker completes the decodes it had, a new
decode worker the prompts it was computing): nothing is drained to idle, no engine restarts.

The split is set by hand (`POST /pdserve/roles`, `pdserve roles`) or, with `--flex-auto`, by
`AutoRatio` from the queues the workers report. The router remembers it: a flex worker that
joins takes the role a worker that left held (a replacement comes back where its predecessor
was), and only when no role lacks one does it get the initial split's. Several routers share
the split through Redis (router/shared/sync.py): what one changes, `changes()` hands over to be
written, and what the others changed comes back through `take_shared`.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.core.kinds import Role
from router.http.errors import invalid_request
from router.shared.state import STANDBY  # a flex worker in no pool (a sweep's ratio with fewer)
from router.workers.handle import WorkerHandle
from router.workers.load import LOAD_POLL_S
from router.workers.pool import TAKES_REQUESTS

log = logging.getLogger("pdserve.router")
FLEX_ROLES = (Role.PREFILL, Role.DECODE)


def initial_role(flex_count: int, prefill_now: int) -> str:
    """A newly joined flex worker's role: half the flex workers prefill (rounded down), so at
    least one decodes."""
    return Role.PREFILL if prefill_now < flex_count // 2 else Role.DECODE


@dataclass(frozen=True)
class RoleChange:
    worker_id: str
    before: str
    after: str
    reason: str

    def body(self) -> dict:
        return {"worker": self.worker_id, "from": self.before, "to": self.after}


class RoleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.workers = Gauge(
            "pdserve_flex_workers",
            "Flex workers now in each role",
            ["role"],
            registry=registry,
        )
        self.changes = Counter(
            "pdserve_role_changes_total",
            "Flex workers moved to a role, by role and by who moved them (manual, auto)",
            ["role", "by"],
            registry=registry,
        )
        for role in FLEX_ROLES + (STANDBY,):
            self.workers.labels(role).set(0)

    def count(self, flex: list[WorkerHandle]) -> None:
        for role in FLEX_ROLES + (STANDBY,):
            self.workers.labels(role).set(sum(w.role == role for w in flex))


class FlexRoles:
    def __init__(self, pool, metrics: RoleMetrics) -> None:
        self.pool = pool
        self.metrics = metrics
        self.wanted = dict.fromkeys(FLEX_ROLES + (STANDBY,), 0)  # flex workers per role, as set
        self.moved: dict[str, str] = {}  # worker id -> role moved here, not yet shared
        # worker id -> (first role given here, whether that added to `wanted`), not yet shared
        self.placed: dict[str, tuple[str, bool]] = {}
        self.split_changed = False  # a move here changed `wanted`, not yet shared
        self.shared: dict[str, str] = {}  # worker id -> role, as the routers last shared it
        self.leads_ratio = True  # --flex-auto decides here (one router of several does)

    def flex(self) -> list[WorkerHandle]:
        return [w for w in self.pool.workers if w.flex]

    def place_new(self) -> None:
        """Give every flex worker without a role (just joined) its initial one."""
        flex = self.flex()
        for worker in flex:
            if worker.role:
                continue
            if worker.identity.worker_id in self.shared:  # another router placed it first
                worker.role = self.shared[worker.identity.worker_id]
            else:
                lacking = [r for r in self.wanted if self._count(r) < self.wanted[r]]
                if lacking:  # a worker in that role left: this one takes its place
                    worker.role = lacking[0]
                else:
                    prefill = sum(w.role == Role.PREFILL for w in flex)
                    worker.role = initial_role(len(flex), prefill)
                    self.wanted[worker.role] += 1
                self.placed[worker.identity.worker_id] = (worker.role, not lacking)
            log.info("flex worker %s joins the %s pool", worker.identity.worker_id, worker.role)
        self.metrics.count(flex)

    def changes(self) -> tuple[dict[str, str], dict[str, tuple[str, bool]], dict[str, int]]:
        """(moved, placed, the split if a move set it) since the last call, to share; cleared
        here."""
        moved, placed = self.moved, self.placed
        split = dict(self.wanted) if self.split_changed else {}
        self.moved, self.placed, self.split_changed = {}, {}, False
        return moved, placed, split

    def unshared(self, moved: dict, placed: dict, split: dict) -> None:
        """Changes that could not be shared (Redis away): kept for the next try, behind any
        made since."""
        self.moved = {**moved, **self.moved}
        self.placed = {**placed, **self.placed}
        self.split_changed = self.split_changed or bool(split)

    def take_shared(self, roles: dict[str, str], split: dict[str, int]) -> None:
        """The split as the routers share it: another router's moves take effect here (those
        made here since are shared next, and win). What the shared state lacks (Redis
        restarted empty) this router's view puts back at the next round."""
        self.shared = roles
        for worker in self.flex():
            role = roles.get(worker.identity.worker_id)
            mine = (
                worker.identity.worker_id in self.moved or worker.identity.worker_id in self.placed
            )
            if not role and worker.role and not mine:
                self.placed[worker.identity.worker_id] = (worker.role, False)
            elif role and not mine and worker.role and role != worker.role:
                log.info(
                    "flex worker %s: %s -> %s (by another router)",
                    worker.identity.worker_id,
                    worker.role,
                    role,
                )
                worker.role = role
        if split and not self.split_changed:
            self.wanted.update(split)
        elif not split and any(self.wanted.values()):
            self.split_changed = True
        self.metrics.count(self.flex())

    def view(self) -> dict:
        flex = self.flex()
        return {
            "workers": [
                {
                    "worker": w.identity.worker_id,
                    "address": w.address,
                    "role": w.role,
                    "flex": w.flex,
                }
                for w in self.pool.workers
            ],
            "flex": {role: sum(w.role == role for w in flex) for role in FLEX_ROLES + (STANDBY,)},
        }

    def set_split(self, prefill: int | None, decode: int | None, by: str) -> list[RoleChange]:
        """Make `prefill` flex workers prefill and `decode` of them decode (either one given:
        the rest do the other; both adding up to fewer: the rest stand by, in no pool), moving
        as few as possible, the least busy first. At least one worker must be left to take
        whole requests (a decode or colocated worker)."""
        flex = self.flex()
        if not flex:
            raise invalid_request("this cluster has no flex workers", param="prefill")
        if prefill is None and decode is None:
            raise invalid_request("give prefill or decode (how many flex workers)")
        prefill = len(flex) - decode if prefill is None else prefill
        decode = len(flex) - prefill if decode is None else decode
        fixed_takers = [w for w in self.pool.workers if not w.flex and w.role != Role.PREFILL]
        if prefill < 0 or decode < (0 if fixed_takers else 1) or prefill + decode > len(flex):
            raise invalid_request(
                f"prefill ({prefill}) and decode ({decode}) must add up to at most the "
                f"{len(flex)} flex workers, and at least one worker must decode",
                param="prefill",
            )
        wanted = {Role.PREFILL: prefill, Role.DECODE: decode, STANDBY: len(flex) - prefill - decode}
        changes = []
        # Workers leave the pools with too many for the pools with too few, least busy first.
        for short in FLEX_ROLES + (STANDBY,):
            for long in (STANDBY,) + FLEX_ROLES:
                while self._count(short) < wanted[short] and self._count(long) > wanted[long]:
                    givers = [w for w in self.flex() if w.role == long]
                    giver = min(givers, key=lambda w: w.load.busyness(long))
                    changes.append(self.move(giver, short, by, "asked"))
        return changes

    def _count(self, role: str) -> int:
        return sum(w.role == role for w in self.flex())

    def move(self, worker: WorkerHandle, role: str, by: str, reason: str) -> RoleChange:
        (change,) = self._move([worker], role, by, reason)
        return change

    def _move(self, workers: list[WorkerHandle], role: str, by: str, reason: str):
        changes = []
        for worker in workers:
            change = RoleChange(worker.identity.worker_id, worker.role, role, reason)
            worker.role = role
            self.moved[worker.identity.worker_id] = role
            self.split_changed = True
            if change.before in self.wanted:
                self.wanted[change.before] = max(0, self.wanted[change.before] - 1)
            self.wanted[role] += 1
            self.metrics.changes.labels(role, by).inc()
            log.info(
                "flex worker %s: %s -> %s (%s: %s)",
                worker.identity.worker_id,
                change.before,
                role,
                by,
                reason,
            )
            changes.append(change)
        self.metrics.count(self.flex())
        return changes


@dataclass
class AutoRatioSettings:
    """When AutoRatio moves a worker: the pressure must hold for `patience` checks in a row,
    and at most `max_changes_per_minute` moves happen (hysteresis against flapping)."""

    interval_s: float = 1.0
    patience: int = 3
    max_changes_per_minute: int = 4
    prefill_backlog_tokens: int = 2048  # per prefill worker: the prefill pool is behind
    decode_busy_share: float = 0.75  # of a decode worker's max_num_seqs: decoding is full


class AutoRatio:
    """Moves one flex worker at a time toward the pool under pressure, from what the workers
    report (their Stats, polled every LOAD_POLL_S): the prefill pool is under pressure when its
    outstanding prompt tokens per worker pass `prefill_backlog_tokens`, the decode pool when its
    running requests per worker pass `decode_busy_share` of max_num_seqs, or requests wait in
    its engines. Only the pool under pressure while the other is not gets a worker; with
    neither under pressure (and no prompt waiting), the split drifts back to its start (half
    the flex workers prefill, rounded down), one worker per decision."""

    def __init__(
        self,
        roles: FlexRoles,
        settings: AutoRatioSettings,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.roles = roles
        self.settings = settings
        self.clock = clock  # monotonic seconds: what follow_ratio checks at
        self.leaning: str | None = None  # the pool that wanted a worker at the last check
        self.checks = 0  # checks in a row it did
        self.recent: list[float] = []  # monotonic times of recent moves

    def pressure(self) -> dict:
        """The figures a decision reads, per pool."""
        pool = self.roles.pool
        prefill = pool.live((Role.PREFILL,))
        decode = pool.live((Role.DECODE,))
        backlog = sum(w.load.busyness(Role.PREFILL)[0] for w in prefill)
        running = sum((w.load.report.running_requests if w.load.report else 0) for w in decode)
        waiting = sum((w.load.report.waiting_requests if w.load.report else 0) for w in decode)
        seats = sum(w.identity.max_num_seqs for w in decode) or 1
        return {
            "flex_prefill_workers": sum(w.role == Role.PREFILL for w in self.roles.flex()),
            "prefill_workers": len(prefill),
            "decode_workers": len(decode),
            "prefill_backlog_tokens": backlog,
            "prefill_backlog_per_worker": backlog / max(1, len(prefill)),
            "decode_running": running,
            "decode_waiting": waiting,
            "decode_busy_share": running / seats,
        }

    def wanted(self, figures: dict) -> str | None:
        s = self.settings
        prefill_short = figures["prefill_backlog_per_worker"] > s.prefill_backlog_tokens
        decode_short = figures["decode_waiting"] > 0 or figures["decode_busy_share"] > (
            s.decode_busy_share
        )
        if prefill_short and not decode_short:
            return Role.PREFILL
        idle_prefill = figures["prefill_backlog_tokens"] == 0
        if decode_short and not prefill_short and idle_prefill:
            return Role.DECODE
        if prefill_short or decode_short:
            return None
        home = len(self.roles.flex()) // 2
        if figures["flex_prefill_workers"] > home and idle_prefill:
            return Role.DECODE
        if figures["flex_prefill_workers"] < home:
            return Role.PREFILL
        return None

    def check(self, now: float) -> RoleChange | None:
        """One decision: a move, or None."""
        figures = self.pressure()
        want = self.wanted(figures)
        self.checks = self.checks + 1 if want is not None and want == self.leaning else 1
        self.leaning = want
        self.recent = [t for t in self.recent if now - t < 60]
        if want is None or self.checks < self.settings.patience:
            return None
        if len(self.recent) >= self.settings.max_changes_per_minute:
            return None
        other = Role.DECODE if want == Role.PREFILL else Role.PREFILL
        givers = [w for w in self.roles.flex() if w.role == other]
        takers_left = len(self.roles.pool.live(TAKES_REQUESTS)) - (other == Role.DECODE)
        if not givers or (other == Role.DECODE and takers_left < 1):
            return None
        giver = min(givers, key=lambda w: w.load.busyness(other))
        reason = ", ".join(f"{key}={value:g}" for key, value in figures.items())
        self.recent.append(now)
        self.checks = 0
        return self.roles.move(giver, want, "auto", reason)


async def follow_ratio(auto: AutoRatio) -> None:
    """Forever (cancel to stop): AutoRatio's check every interval."""
    await asyncio.sleep(LOAD_POLL_S * 2)  # a first load report from every worker
    while True:
        try:
            if auto.roles.leads_ratio:
                auto.check(auto.clock())
        except Exception:  # a decision gone wrong must not stop the router's other work
            log.exception("automatic ratio check failed")
        await asyncio.sleep(auto.settings.interval_s)
