"""What runs beside the routes for the app's lifetime: workers marked down asked whether they
are back, every worker's load polled, membership followed in the registry (or the fixed
workers waited for), the state the routers share kept in step (with a registry), and the flex
workers' split kept to the backlog when asked."""

import asyncio
import contextlib
import logging

from fastapi import FastAPI

from pdserve.protocol.registry import Registry
from router.shared.state import SharedState, router_id
from router.shared.sync import StateSync
from router.workers.flex_roles import AutoRatio, AutoRatioSettings, follow_ratio
from router.workers.pool import WorkerPool, follow_load, follow_registry

log = logging.getLogger("pdserve.router")
DOWN_WORKER_CHECK_S = 2.0  # how often workers marked down are asked whether they are back
STOP_TIMEOUT_S = 3.0  # for each step of the router's stop
# How long a router with a registry waits, before it takes requests, for its first read of the
# membership (each listed worker asked whether it is ready): one (re)started beside serving
# workers would otherwise answer its first requests "no worker has joined yet". Past it (Redis
# not answering), it starts with empty pools and fills them when the registry answers.
FIRST_SYNC_WAIT_S = 10.0


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    state = app.state
    settings, pool, roles = state.settings, state.pool, state.roles
    tasks = [
        asyncio.create_task(_watch_down_workers(pool)),
        asyncio.create_task(
            follow_load(
                pool, unresponsive_s=settings.worker_unresponsive_timeout_s, metrics=state.metrics
            )
        ),
    ]
    registry = shared = None
    if settings.registry and not settings.worker_addresses:
        registry = Registry(settings.registry, settings.cluster)
        synced = asyncio.Event()
        following = follow_registry(
            pool, registry, settings.registry_refresh_s, roles.place_new, state.metrics, synced
        )
        tasks.append(asyncio.create_task(following))
        try:
            async with asyncio.timeout(FIRST_SYNC_WAIT_S):
                await synced.wait()
        except TimeoutError:
            log.warning(
                "no membership read from the registry at %s in %g s: starting with empty pools",
                registry.url,
                FIRST_SYNC_WAIT_S,
            )
    else:
        await pool.wait_ready(settings.worker_ready_timeout_s)
        roles.place_new()
    if settings.registry:
        shared = SharedState(settings.registry, settings.cluster, router_id(settings.port))
        index = getattr(state.choice.policy, "index", None)  # cache-aware's
        state.sync = StateSync(shared, roles, index, state.peers, settings.flex_auto, state.metrics)
        syncing = asyncio.create_task(state.sync.follow(settings.registry_refresh_s))
        tasks.append(syncing)
    if settings.flex_auto:
        auto = AutoRatioSettings(
            prefill_backlog_tokens=settings.flex_auto_backlog,
            max_changes_per_minute=settings.flex_auto_max_moves,
        )
        tasks.append(asyncio.create_task(follow_ratio(AutoRatio(roles, auto))))
    yield
    if state.sync is not None:  # ends between rounds, never inside a Redis command
        state.sync.stop()
        await asyncio.wait([syncing], timeout=STOP_TIMEOUT_S)
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)
    for client in (registry, shared):
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_TIMEOUT_S):
                    await client.close()
    await pool.close()


async def _watch_down_workers(pool: WorkerPool) -> None:
    while True:
        await asyncio.sleep(DOWN_WORKER_CHECK_S)
        await pool.refresh()
