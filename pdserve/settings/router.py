"""The router's settings: where it listens, where its workers are, and how it routes."""

import ipaddress
import os
from typing import Annotated, Literal

from pydantic import Field

from pdserve.settings.base import Settings
from pdserve.settings.engine import Model
from pdserve.settings.secret_fields import ClusterSecretFile, TlsDir
from pdserve.settings.worker import ClusterName, OtlpEndpoint

POLICIES = ("least-loaded", "round-robin", "cache-aware")
# How a request's path is chosen (router/flow/route_choice.py).
ESTIMATE, LENGTH = "estimate", "length"
ROUTE_POLICIES = (ESTIMATE, LENGTH)
# When the decode worker of a disaggregated request hears of it (router/flow/disaggregation.py).
WITH_PREFILL, AFTER_PREFILL = "with-prefill", "after-prefill"
ADMISSIONS = (WITH_PREFILL, AFTER_PREFILL)
UNRESPONSIVE_TIMEOUT_S = 10.0  # a worker answering nothing this long leaves the pools
WORKER_WAIT_S = 10.0  # a request with no worker to try waits this long for one before its 503

Host = Annotated[str, Field(default="127.0.0.1", description="router bind address")]
Port = Annotated[int, Field(default=8000, ge=0, description="router port")]
Policy = Annotated[
    Literal[POLICIES],
    Field(
        default="round-robin",
        description="how a worker is chosen within a pool: round-robin, least-loaded, or "
        "cache-aware (the prefix each worker likely holds; on the disaggregated path the prefill "
        "worker then sends only the KV blocks the decode worker lacks)",
    ),
]
RoutePolicy = Annotated[
    Literal[ROUTE_POLICIES],
    Field(
        default=ESTIMATE,
        description="how a request's path is chosen: estimate (the cheapest of local, "
        "disaggregated and stay-on-prefill, priced from the workers' live load and learned step "
        "costs) or length (disaggregate every prompt of at least --disaggregate-min-tokens)",
    ),
]
DisaggregateMinTokens = Annotated[
    int,
    Field(
        default=256,
        ge=0,
        description="prompts shorter than this are never disaggregated (their KV is not worth "
        "a transfer); with --route-policy length, longer ones always are",
        json_schema_extra={"metavar": "TOKENS"},
    ),
]
DecodeAdmission = Annotated[
    Literal[ADMISSIONS],
    Field(
        default=AFTER_PREFILL,
        description="when a decode worker hears of a disaggregated request: with-prefill (at once; "
        "it reserves the KV blocks while the prompt computes) or after-prefill (with the "
        "prefill's first token; see docs/architecture.md)",
    ),
]
KvTimeoutS = Annotated[
    float,
    Field(
        default=30.0,
        gt=0,
        description="how long a decode worker waits for a prompt's KV",
        json_schema_extra={"flag": "--kv-timeout", "metavar": "SECONDS"},
    ),
]
DefaultMaxTokens = Annotated[
    int, Field(default=512, ge=1, description="max_tokens when a request gives none")
]
RequestTimeoutS = Annotated[
    float,
    Field(
        default=600.0,
        gt=0,
        description="the request's one deadline in seconds, from arrival, shared by every leg, "
        "retry and migration (a client may ask for less with x-pdserve-timeout)",
        json_schema_extra={"flag": "--request-timeout"},
    ),
]


class RouterSettings(Settings):
    host: Host
    port: Port
    model: Model = Field(
        description="where the tokenizer comes from: a `pdserve model` name or "
        "a Hugging Face folder"
    )
    served_model_name: str = Field(
        "", description="model name clients send (default: the --model value)"
    )
    registry: str = Field(
        "",
        description="follow the workers in this Redis registry (redis://host:port/db)",
        json_schema_extra={"metavar": "REDIS_URL"},
    )
    cluster: ClusterName
    worker_addresses: list[str] = Field(
        [],
        description="a fixed list of workers instead of a registry",
        json_schema_extra={"cli": False},
    )
    otlp_endpoint: OtlpEndpoint
    policy: Policy
    route_policy: RoutePolicy
    disaggregate_min_tokens: DisaggregateMinTokens
    decode_admission: DecodeAdmission
    kv_timeout_s: KvTimeoutS
    default_max_tokens: DefaultMaxTokens
    request_timeout_s: RequestTimeoutS
    max_concurrent_requests: int = Field(
        0,
        ge=0,
        description="sequences running at once before new requests queue (a request counts "
        "its prompts times its choices, n or best_of; 0: what the decode pool's engines run at "
        "once, the sum of their max_num_seqs)",
        json_schema_extra={"metavar": "N"},
    )
    max_queued_requests: int = Field(
        0,
        ge=0,
        description="requests waiting in the router's queue before new ones get 429 (0: as "
        "many as may run at once)",
        json_schema_extra={"metavar": "N"},
    )
    queue_timeout_s: float = Field(
        30.0,
        gt=0,
        description="longest a request waits in the router's queue before its 429",
        json_schema_extra={"flag": "--queue-timeout"},
    )
    max_queue_wait_s: float = Field(
        0.0,
        ge=0,
        description="refuse a request at once (429, Retry-After from the queue) when its prompt "
        "is predicted to start computing more than this many seconds after its arrival, from "
        "the router's queue and the workers' queued prompts at their learned costs (0: never; "
        "a request that sets x-pdserve-timeout is refused so against that deadline too)",
        json_schema_extra={"flag": "--max-queue-wait", "metavar": "SECONDS"},
    )
    api_key: list[str] = Field(
        [],
        description="a key clients must send (Authorization: Bearer KEY); repeatable; shows in "
        "the process list: prefer --api-key-file or PDSERVE_API_KEYS (default: none, "
        "the router is open unless a file or the variable gives keys: on loopback only, unless "
        "--allow-unauthenticated)",
        json_schema_extra={"metavar": "KEY"},
    )
    api_key_file: str = Field(
        "",
        description="a file of client API keys, one per line",
        json_schema_extra={"metavar": "PATH"},
    )
    operator_api_key_file: str = Field(
        "",
        description="a file of operator API keys, one per line (or PDSERVE_OPERATOR_API_KEYS): "
        "client keys whose requests may also set their priority (priority, x-pdserve-priority) "
        "and path (x-pdserve-route) and join their traceparent; a client key's are ignored",
        json_schema_extra={"metavar": "PATH"},
    )
    admin_api_key_file: str = Field(
        "",
        description="a file of admin API keys, one per line (or PDSERVE_ADMIN_API_KEYS): "
        "operator keys that may also call the /pdserve/ routes (the flex workers' roles, the "
        "workers' stats); with keys but no admin key those routes answer 403",
        json_schema_extra={"metavar": "PATH"},
    )
    allow_unauthenticated: bool = Field(
        False,
        description="serve with no API key on an address other than loopback (otherwise the "
        "router refuses to start so; PDSERVE_ALLOW_UNAUTHENTICATED=1 does the same)",
    )
    cache_salt_per_key: bool = Field(
        True,
        description="salt the prefix caches (the engines' and the router's index) per API key, so "
        "that requests of different keys never share a cached prefix nor learn of each other's "
        "(a request's cache_salt salts within its key); --no-cache-salt-per-key: keys share",
    )
    cluster_secret_file: ClusterSecretFile
    tls_dir: TlsDir
    public_metrics: bool = Field(
        True,
        description="/metrics answers without an API key (/health always does); otherwise "
        "it needs an operator or admin key (its labels name the workers)",
    )
    worker_ready_timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds to wait for workers to load the model",
        json_schema_extra={"flag": "--worker-ready-timeout"},
    )
    worker_unresponsive_timeout_s: float = Field(
        UNRESPONSIVE_TIMEOUT_S,
        gt=0,
        description="seconds a worker may answer nothing (its Stats, polled every 0.5 s, and "
        "Health) before it leaves the pools; it returns once it answers again for 2 s "
        "(longer each time it was taken out in the last 5 minutes)",
        json_schema_extra={"flag": "--worker-unresponsive-timeout", "metavar": "SECONDS"},
    )
    worker_wait_s: float = Field(
        WORKER_WAIT_S,
        ge=0,
        description="seconds a request waits for a decode or colocated worker when the pools "
        "have none it may try (one whose registry record expired on a late heartbeat, one "
        "restarting), within the request's deadline, before its 503 (0: the 503 at once)",
        json_schema_extra={"flag": "--worker-wait", "metavar": "SECONDS"},
    )
    flex_auto: bool = Field(
        False,
        description="move flex workers between the prefill and decode pools by themselves, "
        "from the queues the workers report (each move logged with its figures)",
    )
    flex_auto_backlog: int = Field(
        2048,
        ge=1,
        description="with --flex-auto: prompt tokens waiting per prefill worker beyond which "
        "the prefill pool wants a worker",
        json_schema_extra={"metavar": "TOKENS"},
    )
    flex_auto_max_moves: int = Field(
        4,
        ge=1,
        description="with --flex-auto: role changes per minute at most",
        json_schema_extra={"metavar": "N"},
    )
    registry_refresh_s: float = Field(
        0.1,
        gt=0,
        description="how often membership is read from the registry",
        json_schema_extra={"cli": False},
    )

    @property
    def served_model(self) -> str:
        return self.served_model_name or self.model


ENV = "PDSERVE_API_KEYS"
OPERATOR_ENV = "PDSERVE_OPERATOR_API_KEYS"
ADMIN_ENV = "PDSERVE_ADMIN_API_KEYS"
ALLOW_UNAUTHENTICATED_ENV = "PDSERVE_ALLOW_UNAUTHENTICATED"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, or every address ("")


def unauthenticated_allowed(settings: RouterSettings, environ=os.environ) -> bool:
    """--allow-unauthenticated, or PDSERVE_ALLOW_UNAUTHENTICATED=1."""
    chosen = environ.get(ALLOW_UNAUTHENTICATED_ENV, "").lower() in ("1", "true", "yes")
    return settings.allow_unauthenticated or chosen


def open_refusal(where: str) -> str:
    """Why a router without an API key does not start at `where` (e.g. "--host 0.0.0.0"), an
    address beyond loopback (security review M7: router/http/api_keys.py, and `pdserve up`'s checks
    before anything starts)."""
    return (
        f"{where}: no API key is set, so the router would serve anyone who reaches it (and let "
        f"them change the flex workers' roles); give keys ({ENV}, --api-key-file), or allow "
        f"it ({ALLOW_UNAUTHENTICATED_ENV}=1, --allow-unauthenticated)"
    )
