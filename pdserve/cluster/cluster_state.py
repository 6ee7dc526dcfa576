"""What `pdserve up` created, written to a file so that `down`, `status` and `scale` (other
processes, later) find the same Ray namespace, registry and services."""

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from pdserve.settings.config_error import ConfigError


@dataclass(frozen=True)
class ClusterState:
    name: str
    config_path: str  # the cluster file, absolute
    ray_address: str
    namespace: str  # the Ray namespace holding the actors and placement groups
    registry_url: str
    router_url: str
    log_dir: str
    ray_group: int = 0  # process group of the Ray head `up` started (0: not ours)
    redis_group: int = 0  # process group of the Redis server `up` started (0: not ours)
    loopback: bool = False  # one-node cluster: workers listen on 127.0.0.1 only
    cluster_secret: str = (
        ""  # pdserve/settings/cluster_secret.py: what `scale` calls the workers with
    )
    ray_auth: str = "token"  # RAY_AUTH_CHOICES: "off" only for a loopback head `up` started
    ray_token_path: str = ""  # the token of the head `up` started ("": the user's own Ray token)

    def ray_token(self) -> str | None:
        """What every command connects to Ray with (ray_launcher.connect): the token file, ""
        for the user's own Ray token, None for no auth."""
        return None if self.ray_auth == "off" else self.ray_token_path


RAY_AUTH_CHOICES = ("token", "off")


def state_dir() -> Path:
    return Path(
        os.environ.get("PDSERVE_STATE_DIR") or Path.home() / ".cache" / "pdserve" / "clusters"
    )


def state_path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def ray_token_file(name: str) -> Path:
    """Where `up` keeps the token of the Ray head it starts (0600, beside the cluster's logs)."""
    return state_dir() / name / "ray-auth-token"


def save_state(state: ClusterState) -> None:
    path = state_path(state.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.touch(mode=0o600)  # it holds the cluster secret: for its owner's eyes only
    temporary.chmod(0o600)
    temporary.write_text(json.dumps(asdict(state), indent=2) + "\n")
    temporary.replace(path)


def load_state(name: str) -> ClusterState | None:
    """The state `up` saved (None: none); ConfigError when the file holds none it could have
    written (not JSON, a field missing, unknown or of the wrong type). A state written by an
    older `up` lacks later fields: they take their defaults."""
    path = state_path(name)
    if not path.is_file():
        return None
    try:
        state = ClusterState(**json.loads(path.read_text()))
    except (ValueError, TypeError, RecursionError) as error:
        raise ConfigError(f"{path} is no cluster state `pdserve up` wrote: {error}") from None
    for field in fields(ClusterState):
        if type(getattr(state, field.name)) is not field.type:  # exactly: a bool is no int
            raise ConfigError(f"{path} is no cluster state `pdserve up` wrote: {field.name}")
    return state


def forget_state(name: str) -> None:
    state_path(name).unlink(missing_ok=True)
