"""The router's HTTP app: the OpenAI endpoints, health, metrics, and a worker stats view.

`create_app` only assembles: it makes the router's parts, keeps them in `app.state` (where
the routes of router/http/ reach them), and adds the routes, the error handlers, the API-key
check and the background tasks (router/lifespan.py).
"""

import time

from pdserve.settings.router import RouterSettings
from router.flow.accounting import Accounting
from router.flow.admission_gate import AdmissionGate
from router.flow.relay import Relay
from router.flow.retries import Starter
from router.flow.tokenization import PromptTokenizer, TokenizerThreads
from router.flow.wait_forecast import WaitForecast
from router.http import cluster, generation, tokens
from router.http import error_handlers as errors
from router.http.api_keys import load_api_keys, open_paths
from router.http.body import BodyBytes
from router.http.direct_routes import RouterApp, direct_routes
from router.http.openai_types import MAX_BATCH_PROMPTS
from router.lifespan import lifespan
from router.metrics import RouterMetrics
from router.shared.state import Peers
from router.workers.choice import WorkerChoice
from router.workers.flex_roles import FlexRoles, RoleMetrics
from router.workers.policies import POLICIES
from router.workers.pool import WorkerPool

MAX_BODY_BYTES = 32 << 20  # a request body beyond this is refused (413) before it is read whole
# Below it, the limit follows the context (security review H2): what a request holds besides
# its prompts (messages' fields, stop strings, logit_bias, structured outputs...), and per token
# of each of MAX_BATCH_PROMPTS prompts as JSON (an id and its comma; text, escaped)
BODY_BASE_BYTES = 4 << 20
BODY_BYTES_PER_TOKEN = 16


def body_limit(max_model_len: int) -> int:
    """The largest request body taken with workers of this context (0: none known yet)."""
    if not max_model_len:
        return MAX_BODY_BYTES
    prompts = MAX_BATCH_PROMPTS * max_model_len * BODY_BYTES_PER_TOKEN
    return min(MAX_BODY_BYTES, BODY_BASE_BYTES + prompts)


def create_app(settings: RouterSettings, model: str) -> RouterApp:
    """`model`: where the tokenizer comes from (a folder, or a hub id)."""
    # No /docs, /redoc or /openapi.json: the API is OpenAI's (docs/http-api.md), and an
    # internet-facing router need not describe its admin routes (security review L8).
    app = RouterApp(
        title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    state = app.state
    state.settings, state.model, state.started = settings, model, int(time.time())
    state.pool = pool = WorkerPool(list(settings.worker_addresses))
    state.choice = choice = WorkerChoice(pool, POLICIES[settings.policy]())
    state.max_body_bytes = lambda: body_limit(pool.max_model_len)
    state.bodies = BodyBytes()  # the bodies being read, all connections together
    state.metrics = metrics = RouterMetrics()
    state.tokenizer = PromptTokenizer(model, lambda: pool.max_model_len)
    state.tokenizing = TokenizerThreads()  # admission and /tokenize, off the event loop
    state.starter = Starter(settings, pool, choice, metrics)
    state.accounting = accounting = Accounting(metrics, choice.policy.cache_lost)
    state.relay = Relay(accounting)
    state.roles = FlexRoles(pool, RoleMetrics(metrics.registry))
    # Several routers (router/shared/sync.py) split the cluster-wide bounds between them.
    state.peers = peers = Peers()
    state.sync = None  # router/shared/sync.py's StateSync, with a registry
    state.gate = AdmissionGate(
        lambda: peers.share(settings.max_concurrent_requests or pool.capacity()),
        lambda: peers.share(
            settings.max_queued_requests or settings.max_concurrent_requests or pool.capacity()
        ),
        settings.queue_timeout_s,
        metrics,
        WaitForecast(pool),
    )
    state.api_keys, state.unguarded = load_api_keys(settings), open_paths(settings)
    if state.api_keys:
        app.add_middleware(errors.ApiKeyGuard, state=state)
    for error_class, handler in errors.HANDLERS.items():
        app.add_exception_handler(error_class, handler)
    for module in (cluster, tokens, generation):
        app.include_router(module.routes)
    app.direct_routes = direct_routes(generation.routes, state)  # router/http/direct_routes.py
    return app
