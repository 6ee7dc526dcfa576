"""Which running cluster a command (`down`, `status`, `scale`) means: `-f cluster.yaml` or
`--name NAME`, looked up in the state `pdserve up` saved."""

import argparse
import os
from pathlib import Path

from cluster.cluster_state import ClusterState, load_state, state_path
from settings.base import ConfigError
from settings.cluster_file import load_cluster_file
from settings.cluster_secret import SECRET_ENV


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
