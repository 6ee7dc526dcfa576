"""The names that cross process boundaries (settings, the worker protocol, registry records,
metrics labels, HTTP headers), as enums so that a typo is an error, not a silent new value.
They are `StrEnum`s: each compares equal to, and serialises as, the string it has always been."""

from enum import StrEnum


class Role(StrEnum):
    """What a worker does: prefill only, decode only, both in one engine, or either on demand."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"
    FLEX = "flex"


class Transport(StrEnum):
    """How a prompt's KV moves from a prefill worker to a decode worker (kv_transfer/)."""

    GRPC = "grpc"
    NCCL = "nccl"  # torch.distributed point to point: NCCL between GPUs, gloo between CPUs
    SHM = "shm"


AUTO_TRANSPORT = "auto"  # a worker's --kv-transport that lets the pair's hosts and devices choose
# A decode worker's failed transfer: it lacked the prefix blocks the prefill worker skipped
# sending (decode_workers/load_plan.py), and computed the prompt itself.
KV_NOT_HELD = "not_held"


class RoutePath(StrEnum):
    """The path a request takes through the cluster (named so as not to shadow pathlib.Path)."""

    LOCAL = "local"  # the decode worker prefills the prompt itself
    DISAGGREGATED = "disaggregated"  # a prefill worker computes the KV and sends it
    STAY_ON_PREFILL = "stay-on-prefill"  # the prefill worker decodes too; no KV moves


class RouteReason(StrEnum):
    """Why a request took its path (the `reason` label of pdserve_route_decisions_total)."""

    ESTIMATE = "estimate"  # the cheapest path by the estimate
    LENGTH = "length"  # --route-policy length: the prompt is at least the floor
    BELOW_FLOOR = "below_floor"  # shorter than --disaggregate-min-tokens
    HEADER = "header"  # the client's x-pdserve-route
    NO_PREFILL_WORKER = "no_prefill_worker"  # none up, or none with compatible KV
    PREFILL_LOST = "prefill_lost"  # every prefill worker was lost during the request
