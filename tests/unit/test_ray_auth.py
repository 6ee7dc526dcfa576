"""Ray under `pdserve up` authenticates (review C1): the head it starts runs Ray's token auth with
a token of its own, kept 0600 beside the cluster's state and given to every driver; the only way
out is `--ray-auth off`, which binds Ray to 127.0.0.1 and refuses anything else; and the
cluster's secrets never ride in an actor's options, which Ray's state API shows to anyone who
asks. No Ray cluster starts here: tests/integration/test_cluster_ray.py checks, on its `pdserve
up` cluster, that a process without the token cannot join it."""

import json
import os
import socket
import stat
from dataclasses import asdict
from pathlib import Path

import pytest
import ray
from ray._private import ray_constants

from pdserve import cli
from pdserve.cluster import down, local_services, ray_launcher
from pdserve.cluster.cluster_state import (
    ClusterState,
    load_state,
    ray_token_file,
    save_state,
    state_path,
)
from pdserve.settings.cluster_secret import SECRET_ENV
from pdserve.settings.config_error import ConfigError
from pdserve.settings.redis_url import PASSWORD_ENV
from pdserve.settings.tls import TLS_DIR_ENV

SECRET = "the-cluster-secret-" + "x" * 30
PASSWORD = "the-redis-password"
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(autouse=True)
def ray_environment_restored(monkeypatch):
    """Whatever a test makes this process's Ray environment, the next one starts from the
    caller's (connect changes os.environ and one of Ray's constants)."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", LOOPBACK_ONLY):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)


def test_the_head_runs_token_auth_even_when_the_caller_turned_it_off(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # what pdserve's docs once said to export
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses-token")
    token = tmp_path / "ray-auth-token"
    environment = local_services.ray_environment(token)
    assert environment["RAY_AUTH_MODE"] == "token"
    assert environment["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert "RAY_AUTH_TOKEN" not in environment  # the token is in a file, never in the env
    assert LOOPBACK_ONLY not in environment


def test_only_an_explicit_opt_out_turns_auth_off_and_it_keeps_ray_on_loopback():
    environment = local_services.ray_environment(None)
    assert environment["RAY_AUTH_MODE"] == "disabled"
    assert environment[LOOPBACK_ONLY] == "0"  # Ray then keeps 127.0.0.1 as the node's address
    assert "RAY_AUTH_TOKEN_PATH" not in environment


def test_a_new_token_is_random_and_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "state" / "ray-auth-token"
    local_services.write_ray_token(path)
    first = path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    local_services.write_ray_token(path)
    assert len(first) == 64 and int(first, 16) and path.read_text() != first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def started_head(monkeypatch, tmp_path, **options) -> tuple[list[str], dict]:
    """The command and environment `start_ray_head` would run (nothing runs)."""
    seen = {}

    class Started:
        pid = 4242

    def spawn(command, log_path, env):
        seen.update(command=command, env=env)
        return Started()

    monkeypatch.setattr(local_services, "_spawn", spawn)
    monkeypatch.setattr(local_services, "_wait_listening", lambda *args: None)
    monkeypatch.setattr(local_services, "refuse_unless_loopback", lambda port: None)
    address, group = local_services.start_ray_head(2, 0, tmp_path / "ray.log", **options)
    assert address.startswith("127.0.0.1:") and group == Started.pid
    return seen["command"], seen["env"]


def test_the_head_gets_a_token_file_and_its_starter_becomes_its_driver(monkeypatch, tmp_path):
    command, env = started_head(monkeypatch, tmp_path)
    token = tmp_path / "ray-auth-token"
    assert env["RAY_AUTH_TOKEN_PATH"] == str(token) and env["RAY_AUTH_MODE"] == "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert not [word for word in command if token.read_text() in word]  # not in `ps`
    assert not [word for word in command if word.startswith("--node-ip-address")]
    # Ray's client server, on by default at 10001: on a port of its own (under the token)
    (client,) = [word for word in command if word.startswith("--ray-client-server-port=")]
    assert client != "--ray-client-server-port=10001"
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)


def test_a_head_without_auth_is_bound_to_loopback(monkeypatch, tmp_path):
    command, env = started_head(monkeypatch, tmp_path, auth=False)
    assert "--node-ip-address=127.0.0.1" in command
    assert env["RAY_AUTH_MODE"] == "disabled" and env[LOOPBACK_ONLY] == "0"
    assert not (tmp_path / "ray-auth-token").exists()


def test_a_head_without_auth_that_answers_beyond_loopback_is_refused():
    addresses = local_services.host_addresses()
    if not addresses:
        pytest.skip("this host has no address but loopback")
    with socket.socket() as everywhere, socket.socket() as loopback:
        everywhere.bind(("0.0.0.0", 0))
        everywhere.listen()
        loopback.bind(("127.0.0.1", 0))
        loopback.listen()
        with pytest.raises(RuntimeError, match="refusing to run Ray without auth"):
            local_services.refuse_unless_loopback(everywhere.getsockname()[1])
        local_services.refuse_unless_loopback(loopback.getsockname()[1])


def connected_environment(monkeypatch, *token) -> dict:
    """os.environ as `ray.init` saw it when ray_launcher.connect called it."""
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(os.environ))
    ray_launcher.connect("127.0.0.1:6379", "test", *token)
    return seen


def test_every_driver_connects_with_token_auth(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses-token")
    seen = connected_environment(monkeypatch, str(tmp_path / "ray-auth-token"))
    assert seen["RAY_AUTH_MODE"] == "token"
    assert seen["RAY_AUTH_TOKEN_PATH"] == str(tmp_path / "ray-auth-token")
    assert "RAY_AUTH_TOKEN" not in seen
    assert ray_constants.ENABLE_RAY_CLUSTER


def test_a_cluster_given_by_address_is_joined_with_the_users_own_token(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "the-users-token")
    seen = connected_environment(monkeypatch)
    assert seen["RAY_AUTH_MODE"] == "token" and seen["RAY_AUTH_TOKEN"] == "the-users-token"


def test_a_driver_of_a_head_without_auth_looks_for_it_on_loopback(monkeypatch):
    seen = connected_environment(monkeypatch, None)
    assert seen["RAY_AUTH_MODE"] == "disabled" and seen[LOOPBACK_ONLY] == "0"
    assert not ray_constants.ENABLE_RAY_CLUSTER  # Ray then leaves 127.0.0.1 as it is


def test_nodes_beyond_loopback_are_refused_without_auth(monkeypatch):
    nodes = [{"Alive": True, "NodeManagerAddress": "127.0.0.1"}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    ray_launcher.check_loopback_nodes()
    nodes.append({"Alive": True, "NodeManagerAddress": "10.0.0.7"})
    with pytest.raises(RuntimeError, match="10.0.0.7"):
        ray_launcher.check_loopback_nodes()


@pytest.fixture
def ray_kv(monkeypatch):
    """Ray's internal key-value store, in a dict: (namespace, key) -> value."""
    from ray.experimental import internal_kv

    store = {}

    def put(key, value, overwrite=True, *, namespace=None):
        store[namespace, key] = value.encode() if isinstance(value, str) else value

    monkeypatch.setattr(internal_kv, "_internal_kv_put", put)
    monkeypatch.setattr(
        internal_kv, "_internal_kv_get", lambda key, *, namespace=None: store.get((namespace, key))
    )
    monkeypatch.setattr(
        internal_kv,
        "_internal_kv_del",
        lambda key, *, namespace=None: store.pop((namespace, key), None),
    )
    return store


def test_actors_options_carry_no_secret_and_their_processes_fetch_them(monkeypatch, ray_kv):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    monkeypatch.setenv(TLS_DIR_ENV, "/etc/pdserve/tls")
    monkeypatch.setenv(ray_launcher.MEMBER_NAMESPACE_ENV, "pdserve-test")
    options = ray_launcher.member_env()
    shown = json.dumps(options)  # what Ray's state API would show of the actor
    assert SECRET not in shown and PASSWORD not in shown
    env_vars = options["runtime_env"]["env_vars"]
    assert env_vars[TLS_DIR_ENV] == "/etc/pdserve/tls"
    hook = env_vars[ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR]
    assert hook == "pdserve.cluster.ray_launcher.receive_member_secrets"

    ray_launcher.publish_member_secrets()  # `up`, once connected
    monkeypatch.delenv(SECRET_ENV)
    monkeypatch.delenv(PASSWORD_ENV)
    for name, value in env_vars.items():  # the actor's process, as Ray starts it
        monkeypatch.setenv(name, value)
    ray_launcher.receive_member_secrets()  # its set-up hook, before the actor starts
    assert os.environ[SECRET_ENV] == SECRET and os.environ[PASSWORD_ENV] == PASSWORD

    ray_launcher.forget_member_secrets()  # `down`
    assert not ray_kv
    with pytest.raises(RuntimeError, match="no member secrets"):  # never an open worker
        ray_launcher.receive_member_secrets()


@pytest.mark.parametrize(
    "stored", ["not json", "[1]", json.dumps({SECRET_ENV: 1}), json.dumps({"LD_PRELOAD": "x"})]
)
def test_member_secrets_up_could_not_have_put_fail_the_actors_start(monkeypatch, ray_kv, stored):
    monkeypatch.setenv(ray_launcher.MEMBER_NAMESPACE_ENV, "pdserve-test")
    ray_kv[("pdserve-test", ray_launcher.MEMBER_SECRETS_KEY)] = stored.encode()
    before = dict(os.environ)  # (vLLM's CPU platform sets LD_PRELOAD in a process that imports it)
    with pytest.raises(RuntimeError, match="not what up puts"):
        ray_launcher.receive_member_secrets()
    assert dict(os.environ) == before  # nothing entered the environment, LD_PRELOAD included


def test_the_state_remembers_how_to_reach_ray(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    state = ClusterState("c", "/c.yaml", "127.0.0.1:1", "pdserve-c", "redis://x", "", "/logs")
    assert state.ray_auth == "token" and state.ray_token() == ""  # the user's own token
    ours = str(ray_token_file("c"))
    save_state(ClusterState(**{**asdict(state), "ray_token_path": ours}))
    assert load_state("c").ray_token() == ours
    assert Path(ours).parent == tmp_path / "c"
    assert ClusterState(**{**asdict(state), "ray_auth": "off"}).ray_token() is None
    older = {k: v for k, v in asdict(state).items() if not k.startswith("ray_")}
    state_path("c").write_text(json.dumps({**older, "ray_address": "127.0.0.1:1"}))
    assert load_state("c").ray_token() == ""  # a state written before: token auth


@pytest.mark.parametrize(
    "wrong",
    [{"loopback": "yes"}, {"ray_group": True}, {"ray_group": 1.5}, {"name": None}, {"extra": 1}],
)
def test_a_state_file_up_could_not_have_written_is_a_config_error(monkeypatch, tmp_path, wrong):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    state = ClusterState("c", "/c.yaml", "127.0.0.1:1", "pdserve-c", "redis://x", "", "/logs")
    state_path("c").write_text(json.dumps({**asdict(state), **wrong}))
    with pytest.raises(ConfigError, match="no cluster state"):
        load_state("c")
    for text in ("not json", "[1]", json.dumps({"name": "c"})):  # not JSON, fields missing
        state_path("c").write_text(text)
        with pytest.raises(ConfigError, match="no cluster state"):
            load_state("c")


def test_auth_off_is_refused_for_a_cluster_given_by_address(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(ray_launcher, "connect", lambda *args: pytest.fail("asked Ray"))
    path = tmp_path / "cluster.yaml"
    path.write_text("prefill: {replicas: 1}\ndecode: {replicas: 1}\n")
    command = ["up", "-f", str(path), "--address", "10.0.0.7:6379", "--ray-auth", "off"]
    assert cli.main(command) == 2
    assert "--ray-auth off" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_down_forgets_the_secrets_and_removes_the_heads_token(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    token = local_services.write_ray_token(ray_token_file("c"))
    calls = []
    monkeypatch.setattr(ray_launcher, "connect", lambda *args: calls.append(("connect", args)))
    monkeypatch.setattr(down.replica_keeper, "stop", lambda name: False)
    monkeypatch.setattr(ray_launcher, "actor_names", lambda name: [])
    monkeypatch.setattr(ray_launcher, "wait_gone", lambda name, names: [])
    monkeypatch.setattr(ray_launcher, "remove_orphan_groups", lambda name: [])
    monkeypatch.setattr(ray_launcher, "forget_member_secrets", lambda: calls.append("forget"))
    monkeypatch.setattr(ray_launcher.ray, "shutdown", lambda: None)
    monkeypatch.setattr(local_services, "stop_ray_head", lambda group: calls.append("stop"))
    monkeypatch.setattr(down, "stop_group", lambda group: None)
    state = ClusterState(
        "c", "/c.yaml", "127.0.0.1:1", "pdserve-c", "redis://x", "", "/logs",
        ray_group=77, redis_group=78, ray_token_path=str(token),
    )  # fmt: skip
    save_state(state)
    down.tear_down(state)
    assert calls == [("connect", ("127.0.0.1:1", "c", str(token))), "forget", "stop"]
    assert not token.exists() and load_state("c") is None
