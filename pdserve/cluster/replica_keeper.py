"""The replica keeper: keeps the workers `pdserve up` declared (and `pdserve scale` changed)
running, so a dead worker is replaced without anyone running a command.

It is a detached, named Ray actor (`replica-keeper`, no CPU) in the cluster's namespace, on the
node `up` runs on. Every POLL_S it asks each kept worker's actor to describe itself; a worker
whose actor is gone (killed, crashed, its node lost) or whose process has exited, and one whose
process runs but that never became ready or stopped answering (it is not in the registry:
pdserve/cluster/hung_workers.py), is replaced through the path `up` uses: the old actor is
killed and its placement group removed, then a new group and actor of the same name start the
worker, which joins the pools once its engine is ready. Each slot waits out a crash-loop
back-off first (pdserve/cluster/crash_loop.py). It replaces; it never adds or removes: `scale`
tells it what to keep (`keep`) after its new workers joined and before its surplus workers
drain, and `down` kills it first, so neither is fought. A replaced flex worker joins with no
role, and the router gives it the role the split lacks (router/workers/flex_roles.py).

Ray restarts the keeper itself when its process dies (`max_restarts=-1`; `down` kills it with
no restart); a restarted keeper keeps the workers whose actors live then, which is what it kept
unless one was mid-replacement.

Replacements are counted in `pdserve_worker_replacements_total{role}` (and failed starts in
`pdserve_worker_replacement_failures_total{role}`) on its own Prometheus endpoint, whose URL
`pdserve status` prints with what the keeper is doing; it logs to `<log dir>/replica-keeper.log`.
"""

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from prometheus_client import CollectorRegistry, Counter, start_http_server
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdserve.cluster import ray_launcher
from pdserve.cluster.crash_loop import CrashLoopBackoff
from pdserve.cluster.hung_workers import why_hung
from pdserve.cluster.local_workers import threads_per_worker
from pdserve.cluster.placement import slot_named
from pdserve.protocol.registry import read_members
from pdserve.settings.cluster_file import ClusterFile

KEEPER = "replica-keeper"
POLL_S = 1.0
DESCRIBE_TIMEOUT_S = 5.0  # a busy actor (stopping its process) is judged on a later pass
STOP_GRACE_S = 10.0  # the old worker's process, if it still runs (it exited, or Ray lost it)
CALL_TIMEOUT_S = 30.0
EVENTS_KEPT = 20

log = logging.getLogger("pdserve.replica_keeper")


@dataclass(frozen=True)
class KeeperReport:
    """What the keeper is doing, as `pdserve status` shows it (returned through Ray)."""

    keeping: tuple[str, ...]  # the workers it keeps
    replacements: dict[str, int]  # role -> workers replaced so far
    failed_starts: dict[str, int]  # role -> replacements that could not start
    waiting: dict[str, float]  # worker -> seconds left of its crash-loop back-off
    metrics_url: str
    events: tuple[str, ...]  # the latest, oldest first


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaKeeper:
    """See the module docstring. Its loop runs in a thread; `keep` and `report` are Ray calls."""

    def __init__(
        self,
        cluster: str,
        config: ClusterFile,
        registry_url: str,
        log_dir: str,
        loopback: bool,
        names: list[str],
    ) -> None:
        handler = logging.FileHandler(Path(log_dir) / "replica-keeper.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        self.cluster = cluster
        self.config = config
        self.registry_url = registry_url
        self.log_dir = log_dir
        self.loopback = loopback
        self.lock = threading.Lock()  # one replacement pass or one `keep` at a time
        restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if restarted:  # `keep` may have changed the list since `up`: the live workers are it
            names = [name for name in ray_launcher.actor_names(cluster) if _is_worker(config, name)]
        now = time.monotonic()
        self.kept = {name: CrashLoopBackoff(started_at=now) for name in names}
        self.last_listed: dict[str, float] = {}  # when each was last seen in the registry
        self.events: deque[str] = deque(maxlen=EVENTS_KEPT)
        self.metrics = metrics = CollectorRegistry()
        self.replacements = Counter(
            "pdserve_worker_replacements",
            "workers replaced after their actor or process died, or they never became ready or "
            "stopped answering",
            ["role"],
            registry=metrics,
        )
        self.failures = Counter(
            "pdserve_worker_replacement_failures",
            "replacements that could not start (placement or actor start failed)",
            ["role"],
            registry=metrics,
        )
        for role in config.pools():  # every pool's series exist from the start, at 0
            self.replacements.labels(role)
            self.failures.labels(role)
        from pdserve.worker.processes import free_port

        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        port = free_port(host)
        start_http_server(port, addr=host, registry=metrics)
        self.metrics_url = f"http://{host}:{port}/metrics"
        self._event(
            f"{'restarted; ' if restarted else ''}keeping {', '.join(sorted(names))}; "
            f"metrics at {self.metrics_url}"
        )
        threading.Thread(target=self._run, name="replica-keeper", daemon=True).start()

    def keep(self, names: list[str]) -> None:
        """From now on keep exactly `names` (what `scale` leaves); waits for a replacement in
        progress, so none starts for a worker that is no longer kept."""
        with self.lock:
            now = time.monotonic()
            self.kept = {n: self.kept.get(n) or CrashLoopBackoff(started_at=now) for n in names}
        self._event(f"keeping {', '.join(sorted(names))}")

    def kept_names(self) -> list[str]:
        return sorted(self.kept)

    def report(self) -> KeeperReport:
        now = time.monotonic()
        kept = dict(self.kept)
        return KeeperReport(
            keeping=tuple(sorted(kept)),
            replacements={r: self._count("replacements", r) for r in self.config.pools()},
            failed_starts={r: self._count("replacement_failures", r) for r in self.config.pools()},
            waiting={
                name: round(backoff.wait_left(now), 1)
                for name, backoff in kept.items()
                if backoff.dead_since is not None
            },
            metrics_url=self.metrics_url,
            events=tuple(self.events),
        )

    def _count(self, what: str, role: str) -> int:
        return int(self.metrics.get_sample_value(f"pdserve_worker_{what}_total", {"role": role}))

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self._pass()
            except Exception:  # a Ray hiccup must not end the keeping; the next pass retries
                log.exception("replica keeper pass failed")
            time.sleep(max(0.0, POLL_S - (time.monotonic() - started)))

    def _pass(self) -> None:
        dead = self._dead(sorted(self.kept))
        if not dead:
            return
        with self.lock:
            now = time.monotonic()
            due = []
            for name, why in dead.items():
                backoff = self.kept.get(name)
                if backoff is None:  # `scale` stopped keeping it meanwhile
                    continue
                first_seen = backoff.dead_since is None
                if backoff.due(now):
                    due.append((name, backoff))
                if first_seen:
                    wait = backoff.wait_left(now)
                    self._event(
                        f"{name}: {why}; replacing it in {wait:.0f} s (crash-loop back-off)"
                    )
            for name, backoff in due:
                backoff.replaced(time.monotonic())
                self.last_listed.pop(name, None)
                self._replace(name)

    def _dead(self, names: list[str]) -> dict[str, str]:
        """{name: why} of the kept workers whose actor is gone or whose process has exited, or
        whose process runs but never became ready or stopped answering."""
        replies, dead, running = {}, {}, []
        for name in names:
            try:
                replies[name] = ray.get_actor(name).describe.remote()
            except ValueError:
                dead[name] = "its actor is gone"
        deadline = time.monotonic() + DESCRIBE_TIMEOUT_S
        for name, reply in replies.items():
            try:
                info = ray.get(reply, timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayActorError:
                dead[name] = "its actor died"
                continue
            except ray.exceptions.RayError:  # its start failed: it holds no process
                dead[name] = "its actor started no process"
                continue
            if info.exit_code is not None:
                dead[name] = f"its process exited ({info.exit_code})"
            else:
                running.append(name)
        return {**dead, **self._hung(running)}

    def _hung(self, names: list[str]) -> dict[str, str]:
        """{name: why} of these workers (their process running) that never became ready or
        stopped answering; none when the registry cannot be read."""
        try:
            listed = {
                record.identity.worker_id
                for record in read_members(self.registry_url, self.cluster)
            }
        except Exception as error:  # Redis away: no one is judged on this pass
            log.warning("cannot read the registry: %s", error)
            return {}
        now, hung = time.monotonic(), {}
        for name in names:
            backoff = self.kept.get(name)
            if backoff is None:
                continue
            if name in listed:
                self.last_listed[name] = now
            why = why_hung(backoff.started_at, self.last_listed.get(name), now)
            if why is not None:
                hung[name] = why
        return hung

    def _replace(self, name: str) -> None:
        """Old actor and placement group out, a new group and actor in (as `up` does)."""
        slot = slot_named(self.config, name)
        try:
            ray_launcher.stop_actors(self.cluster, [name], grace_s=STOP_GRACE_S)
            if ray_launcher.wait_gone(self.cluster, [name]):
                raise RuntimeError("its old actor is still alive after ray.kill")
            info = ray_launcher.start_worker(
                self.cluster,
                slot,
                self.config.worker_settings(slot.role, self.registry_url),
                self.log_dir,
                threads_per_worker(len(self.kept)),
                self.loopback,
                self.config.kv_pool.budget_bytes,
            )
        except (RuntimeError, ray.exceptions.RayError) as error:
            self.failures.labels(slot.role).inc()
            self._event(f"{name}: replacement failed to start: {error}")
            ray_launcher.stop_actors(self.cluster, [name], grace_s=STOP_GRACE_S)
            return
        self.replacements.labels(slot.role).inc()
        self._event(
            f"{name}: replacement started (pid {info.pid}, node {info.node[:12]}, "
            f"log {info.log}); it joins the pools once its engine is ready"
        )

    def _event(self, message: str) -> None:
        log.info("%s", message)
        self.events.append(f"{time.strftime('%H:%M:%S')} {message}")


def _is_worker(config: ClusterFile, name: str) -> bool:
    """Whether the actor `name` is one of the cluster's workers (not its router, nor a keeper)."""
    try:
        slot_named(config, name)
    except ValueError:
        return False
    return True


def start(
    cluster: str,
    config: ClusterFile,
    registry_url: str,
    log_dir: str,
    loopback: bool,
    names: list[str],
) -> str:
    """Start the keeper on this node (`up` calls it once every worker is up); returns its
    metrics URL."""
    keeper = ReplicaKeeper.options(
        name=KEEPER,
        lifetime="detached",
        **ray_launcher.member_env(),
        scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        ),
    ).remote(cluster, config, registry_url, log_dir, loopback, names)
    try:
        return ray.get(keeper.report.remote(), timeout=CALL_TIMEOUT_S).metrics_url
    except ray.exceptions.RayError as error:
        raise RuntimeError(f"the {KEEPER} did not start: {error}") from None


def keeper() -> ray.actor.ActorHandle:
    """The running keeper's handle; RuntimeError when there is none."""
    try:
        return ray.get_actor(KEEPER)
    except ValueError:
        raise RuntimeError(
            f"no {KEEPER} actor: dead workers are not being replaced; "
            "`pdserve down` and `pdserve up` start a new one"
        ) from None


def kept_names() -> list[str]:
    """The workers the keeper keeps: the cluster's workers, as `scale` counts them."""
    return _call("kept_names")


def keep(names: list[str]) -> None:
    _call("keep", names)


def report() -> KeeperReport:
    """The keeper's report; RuntimeError saying why when it does not answer."""
    return _call("report")


def _call(method: str, *args: object) -> Any:
    """RuntimeError saying so when the keeper is missing or does not answer in time."""
    try:
        return ray.get(getattr(keeper(), method).remote(*args), timeout=CALL_TIMEOUT_S)
    except ray.exceptions.RayError as error:
        raise RuntimeError(f"{KEEPER}: {method} failed: {error}") from None


def stop(cluster: str) -> bool:
    """Kill the keeper and wait until it is gone (`down` does this before anything else, so
    nothing it removes is started again). True when there was one."""
    try:
        handle = keeper()
    except RuntimeError:
        return False
    ray.kill(handle, no_restart=True)
    if ray_launcher.wait_gone(cluster, [KEEPER]):
        raise RuntimeError(f"{KEEPER} still alive after ray.kill")
    return True
