"""The cluster secret (pdserve/settings/cluster_secret.py) and the worker's gRPC gate
(pdserve/worker/secret_check.py): a real grpc.aio server on loopback with the real worker service
(its
engine not started), called with and without the secret. KV streams: test_kv_transports.py."""

import asyncio

import grpc
import pytest

from pdserve.protocol import worker_pb2, worker_pb2_grpc
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_secret import (
    METADATA_KEY,
    SECRET_ENV,
    cluster_secret,
    ensure_cluster_secret,
    load_cluster_secret,
    secret_matches,
)
from pdserve.worker.secret_check import SecretCheck
from pdserve.worker.service import WorkerService

SECRET = "the-cluster-secret"


async def calls_to_a_guarded_worker(metadata) -> dict[str, grpc.StatusCode]:
    """Each call's status code (OK when answered) on a worker whose secret is SECRET."""
    server = grpc.aio.server(interceptors=[SecretCheck(SECRET)])
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService("w", "decode", "m"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    codes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            calls = {
                "Health": lambda: stub.Health(
                    worker_pb2.HealthRequest(), timeout=5, metadata=metadata
                ),
                "Abort": lambda: stub.Abort(
                    worker_pb2.AbortRequest(request_id="r"), timeout=5, metadata=metadata
                ),
            }
            for name, call in calls.items():
                try:
                    await call()
                    codes[name] = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    codes[name] = error.code()
            try:  # a streaming call: refused before the service (and its engine) sees it
                async for _ in stub.Generate(
                    worker_pb2.GenerateRequest(request_id="r"), timeout=5, metadata=metadata
                ):
                    pass
            except grpc.aio.AioRpcError as error:
                codes["Generate"] = error.code()
            session = stub.Session(timeout=5, metadata=metadata)
            start = worker_pb2.RequestStart(
                stream_id=1, request=worker_pb2.GenerateRequest(request_id="r")
            )
            try:  # served: the request's end comes back (UNAVAILABLE: no engine here)
                await session.write(worker_pb2.SessionUp(starts=[start]))
                end = (await session.read()).events[0].end
                assert end.code == grpc.StatusCode.UNAVAILABLE.value[0], end
                codes["Session"] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as error:
                codes["Session"] = error.code()
            session.cancel()
    finally:
        await server.stop(grace=None)
    return codes


@pytest.mark.parametrize("offered", [None, "", "a guess", SECRET + "x"])
def test_a_call_without_the_secret_is_refused_whatever_the_method(offered):
    metadata = () if offered is None else ((METADATA_KEY, offered),)
    codes = asyncio.run(calls_to_a_guarded_worker(metadata))
    assert codes == dict.fromkeys(
        ("Health", "Abort", "Generate", "Session"), grpc.StatusCode.UNAUTHENTICATED
    )


def test_a_call_with_the_secret_is_served():
    codes = asyncio.run(calls_to_a_guarded_worker(((METADATA_KEY, SECRET),)))
    assert codes["Health"] == codes["Abort"] == codes["Session"] == grpc.StatusCode.OK


def test_an_open_worker_takes_any_call():
    assert secret_matches("", "") and secret_matches("anything", "")
    assert not secret_matches("", SECRET) and secret_matches(SECRET, SECRET)


def test_the_secret_comes_from_a_file_into_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    load_cluster_secret(str(path))
    assert cluster_secret() == SECRET  # the engine processes started next inherit it
    ensure_cluster_secret()  # one given is kept
    assert cluster_secret() == SECRET


def test_a_missing_or_empty_secret_file_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_secret(str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_cluster_secret(str(tmp_path / "empty"))
    assert cluster_secret() == ""


def test_serve_and_up_generate_a_secret_when_none_is_given(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    ensure_cluster_secret()
    first = cluster_secret()
    monkeypatch.delenv(SECRET_ENV)
    ensure_cluster_secret()
    assert len(first) >= 40 and cluster_secret() != first


def test_ray_actors_get_the_tls_folder_but_never_a_secret_through_their_runtime_env(
    monkeypatch,
):
    """Ray shows every actor's runtime_env: the secrets reach an actor's process otherwise
    (tests/unit/test_ray_auth.py follows them there)."""
    from pdserve.cluster.ray_launcher import MEMBER_NAMESPACE_ENV, member_env
    from pdserve.settings.redis_url import PASSWORD_ENV
    from pdserve.settings.tls import TLS_DIR_ENV

    monkeypatch.setenv(MEMBER_NAMESPACE_ENV, "pdserve-test")
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(PASSWORD_ENV, "redis-password")
    monkeypatch.setenv(TLS_DIR_ENV, "/etc/pdserve/tls")
    env_vars = member_env()["runtime_env"]["env_vars"]
    assert env_vars[TLS_DIR_ENV] == "/etc/pdserve/tls"
    assert SECRET not in env_vars.values() and "redis-password" not in env_vars.values()
    assert SECRET_ENV not in env_vars and PASSWORD_ENV not in env_vars


def test_the_state_file_holding_the_secret_is_its_owners_only(tmp_path, monkeypatch):
    from pdserve.cluster.cluster_state import ClusterState, load_state, save_state, state_path

    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    state = ClusterState(
        "c", "/f.yaml", "ray", "ns", "redis://x", "", "/logs", cluster_secret=SECRET
    )
    save_state(state)
    assert state_path("c").stat().st_mode & 0o777 == 0o600
    assert load_state("c") == state
