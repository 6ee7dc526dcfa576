"""What runs beside the routes for the app's lifetime: workers marked down asked whether they
are back, every worker's load polled, membership followed in the registry (or, without one, the
fixed workers waited for), and the flex workers' split kept to the backlog when asked."""

import asyncio
import contextlib

from fastapi import FastAPI

from pdserve.worker.registry import Registry
from router.flex_roles import AutoRatio, AutoRatioSettings, follow_ratio
from router.worker_pool import WorkerPool, follow_load, follow_registry

DOWN_WORKER_CHECK_S = 2.0  # how often workers marked down are asked whether they are back


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
    registry = None
    if settings.registry:
        registry = Registry(settings.registry, settings.cluster)
        following = follow_registry(pool, registry, settings.registry_refresh_s, roles.place_new)
        tasks.append(asyncio.create_task(following))
    else:
        await pool.wait_ready(settings.worker_ready_timeout_s)
        roles.place_new()
    if settings.flex_auto:
        auto = AutoRatioSettings(
            prefill_backlog_tokens=settings.flex_auto_backlog,
            max_changes_per_minute=settings.flex_auto_max_moves,
        )
        tasks.append(asyncio.create_task(follow_ratio(AutoRatio(roles, auto))))
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if registry is not None:
        await registry.close()
    await pool.close()


async def _watch_down_workers(pool: WorkerPool) -> None:
    while True:
        await asyncio.sleep(DOWN_WORKER_CHECK_S)
        await pool.refresh()
