"""Which running cluster a command (`down`, `status`, `scale`) means: `-f cluster.yaml` or
`--name NAME`, looked up in the state `pdserve up` saved; and its router's flex roles, which
`status` shows and `scale` sets on a cluster of flex workers."""

import argparse
import os
from pathlib import Path

from pdserve.cluster.cluster_state import ClusterState, load_state, state_path
from pdserve.protocol.router_admin import API_KEY_ENV, ask_roles
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import load_cluster_file
from pdserve.settings.cluster_secret import SECRET_ENV

ROUTER_KEYS_ENV = "PDSERVE_API_KEYS"  # the router's keys (router/http/api_keys.py)
ADMIN_KEYS_ENV = "PDSERVE_ADMIN_API_KEYS"  # its admin keys


def add_target_arguments(parser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("-f", "--file", type=Path, help="the cluster file given to `pdserve up`")
    target.add_argument("--name", help="the cluster's name (the file's `name`)")


def target_state(args: argparse.Namespace) -> ClusterState:
    """The saved state, or ConfigError saying why there is none."""
    name = args.name or load_cluster_file(args.file).name
    state = load_state(name)
    if state is None:
        raise ConfigError(f"cluster {name!r} is not up (no {state_path(name)})")
    if state.cluster_secret:  # this command may call the cluster's workers
        os.environ[SECRET_ENV] = state.cluster_secret
    return state


def router_api_key() -> str:
    """The key this command calls the router's /pdserve/ routes with, which need an admin key
    when the router has keys: $PDSERVE_API_KEY (as `pdserve roles`), else the first of
    $PDSERVE_ADMIN_API_KEYS (the router's own admin keys: its actor inherits them under `up`),
    else the first of $PDSERVE_API_KEYS (a router with no admin key refuses them all)."""
    if given := os.environ.get(API_KEY_ENV):
        return given
    for variable in (ADMIN_KEYS_ENV, ROUTER_KEYS_ENV):
        if own := [key.strip() for key in os.environ.get(variable, "").split(",") if key.strip()]:
            return own[0]
    return ""


def router_roles(state: ClusterState, split: dict[str, int] | None = None) -> dict:
    """The cluster router's flex roles, or its reply to setting `split`
    (pdserve/cluster/roles.py)."""
    return ask_roles(state.router_url, split, router_api_key())
