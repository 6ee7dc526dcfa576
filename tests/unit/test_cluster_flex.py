"""A cluster of flex workers on Ray: the `flex:` pool of the cluster file, its placement, and
`pdserve scale` / `status` asking the router for roles instead of starting or stopping workers.
No engine, no Ray: a small HTTP server stands in for the router's /pdserve/roles."""

import argparse
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from pdserve.cluster import ray_launcher, scale, status
from pdserve.cluster.cluster_state import ClusterState, save_state
from pdserve.cluster.cluster_target import router_api_key
from pdserve.cluster.placement import check_layout, check_resources, slot_named, worker_slots
from pdserve.planner.model_spec import MODEL_PRESETS
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import parse_cluster

FLEX_3 = {"name": "flexy", "flex": {"replicas": 3, "kv_failure_policy": "fail"}}


def test_a_flex_pool_replaces_the_prefill_and_decode_pools():
    config = parse_cluster(FLEX_3)
    assert config.is_flex and list(config.pools()) == ["flex"]
    settings = config.worker_settings("flex", "redis://127.0.0.1:6379/0")
    assert settings.role == "flex"
    assert (settings.kv_failure_policy, settings.kv_send_buffer_mib) == ("fail", 256)


def test_without_flex_replicas_the_cluster_keeps_its_fixed_pools():
    for document in (None, {"flex": None}, {"flex": {"replicas": 0}, "prefill": {"replicas": 2}}):
        config = parse_cluster(document)
        assert not config.is_flex and list(config.pools()) == ["prefill", "decode"]


@pytest.mark.parametrize(
    "document, message",
    [
        (
            {"flex": {"replicas": 2}, "decode": {"replicas": 1}},
            "flex: a cluster of flex workers has no decode section",
        ),
        (
            {"flex": {"replicas": 2}, "prefill": None, "decode": None},
            "flex: a cluster of flex workers has no decode or prefill section",
        ),
        ({"flex": {"replicas": -1}}, "flex.replicas: must be an integer >= 0, got -1"),
        ({"flex": {"replica": 2}}, "flex.replica: unknown field (known: replicas, "),
    ],
)
def test_a_bad_flex_pool_is_refused_by_name(document, message):
    with pytest.raises(ConfigError) as caught:
        parse_cluster(document)
    assert message in str(caught.value)


def test_flex_workers_get_slots_of_their_own_and_are_replaced_by_name():
    config = parse_cluster({"flex": {"replicas": 2, "tensor_parallel_size": 2, "gpu_type": "H200"}})
    slots = worker_slots(config)
    assert [(s.name, s.role, s.bundles) for s in slots] == [
        ("flex-0", "flex", ({"GPU": 1.0}, {"GPU": 1.0})),
        ("flex-1", "flex", ({"GPU": 1.0}, {"GPU": 1.0})),
    ]
    assert slot_named(config, "flex-1") == slots[1]
    with pytest.raises(ValueError, match="not a worker name of this cluster"):
        slot_named(config, "decode-0")
    check_resources(slots, [{"GPU": 4.0}])
    with pytest.raises(ConfigError, match="flex.tensor_parallel_size: flex-1 needs 2 GPU"):
        check_resources(slots, [{"GPU": 3.0}, {"GPU": 1.0}])


def test_the_flex_pool_tensor_parallelism_must_divide_the_heads():
    config = parse_cluster({"flex": {"replicas": 2, "tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match="flex.tensor_parallel_size: 2 does not divide"):
        check_layout(config, MODEL_PRESETS["smollm2-135m"])


def test_a_dry_run_plans_flex_workers(tmp_path):
    path = tmp_path / "flex.yaml"
    document = {
        "model": {
            "path": "meta-llama/Llama-3.1-70B-Instruct",
            "preset": "llama-3.1-70b",
            "dtype": "bfloat16",  # float32 would not fit 80 GB at TP 4
        },
        "flex": {"replicas": 2, "tensor_parallel_size": 4, "gpu_type": "H100-SXM"},
    }
    path.write_text(yaml.safe_dump(document))
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "up", "-f", str(path), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PDSERVE_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 0, done.stderr
    assert "flex-1       flex       4  {GPU: 1} {GPU: 1} {GPU: 1} {GPU: 1}" in done.stderr
    assert "GPU 8" in done.stderr and not (tmp_path / "state").exists()


class StandInRouter:
    """/pdserve/roles of a router over flex-0..2 (1 prefill, 2 decode), recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict | None, str]] = []
        self.roles = {"flex-0": "prefill", "flex-1": "decode", "flex-2": "decode"}
        router = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                router.calls.append(("GET", None, self.headers.get("authorization", "")))
                self._answer(200, router.view())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                router.calls.append(("POST", body, self.headers.get("authorization", "")))
                if body.get("prefill", 0) + body.get("decode", 0) > 3:
                    error = {"error": {"message": "must add up to at most the 3 flex workers"}}
                    self._answer(400, error)
                    return
                router.roles.update({"flex-1": "prefill"})
                change = {"worker": "flex-1", "from": "decode", "to": "prefill"}
                self._answer(200, {"changes": [change], "seconds": 0.0, **router.view()})

            def _answer(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def view(self) -> dict:
        workers = [{"worker": w, "role": r, "flex": True} for w, r in self.roles.items()]
        counts = {r: list(self.roles.values()).count(r) for r in ("prefill", "decode", "standby")}
        return {"workers": workers, "flex": counts}


@pytest.fixture
def router():
    stand_in = StandInRouter()
    yield stand_in
    stand_in.server.shutdown()
    stand_in.server.server_close()


def cluster_up(tmp_path, monkeypatch, document: dict, router_url: str) -> ClusterState:
    """A saved state as `up` leaves it, with no Ray: connecting to Ray fails the test."""
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path / "state"))
    for name in ("PDSERVE_API_KEY", "PDSERVE_API_KEYS", "PDSERVE_CLUSTER_SECRET"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(document))
    state = ClusterState(
        name=parse_cluster(document).name,
        config_path=str(path),
        ray_address="127.0.0.1:1",
        namespace="pdserve-test",
        registry_url="redis://127.0.0.1:1/0",
        router_url=router_url,
        log_dir=str(tmp_path),
    )
    save_state(state)

    def no_ray(*args):
        raise RuntimeError("asked Ray")

    monkeypatch.setattr(ray_launcher, "connect", no_ray)
    return state


def scale_args(name: str, prefill: int | None, decode: int | None) -> argparse.Namespace:
    return argparse.Namespace(
        name=name, file=None, prefill=prefill, decode=decode, drain_timeout=600.0
    )


def test_scale_on_a_flex_cluster_moves_roles_through_the_router(
    tmp_path, monkeypatch, router, capsys
):
    cluster_up(tmp_path, monkeypatch, FLEX_3, router.url)
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-test")
    assert scale.run(scale_args("flexy", 2, None)) == 0
    assert router.calls == [("POST", {"prefill": 2}, "Bearer sk-test")]
    printed = capsys.readouterr().err
    assert "flex-1: decode -> prefill" in printed
    assert "roles set to 2 prefill + 1 decode in " in printed and "no engine restarted" in printed


def test_scale_on_a_flex_cluster_reports_the_routers_refusal(tmp_path, monkeypatch, router, capsys):
    cluster_up(tmp_path, monkeypatch, FLEX_3, router.url)
    assert scale.run(scale_args("flexy", 3, 1)) == 2
    assert "refused: must add up to at most the 3 flex workers" in capsys.readouterr().err


def test_scale_on_a_fixed_role_cluster_starts_and_stops_workers_on_ray(
    tmp_path, monkeypatch, router, capsys
):
    cluster_up(tmp_path, monkeypatch, {"name": "fixed"}, router.url)
    assert scale.run(scale_args("fixed", 2, 1)) == 1
    assert "asked Ray" in capsys.readouterr().err
    assert router.calls == []


def test_status_shows_the_role_the_router_gave_each_flex_worker(tmp_path, monkeypatch, router):
    state = cluster_up(tmp_path, monkeypatch, FLEX_3, router.url)
    rows = [{"worker": f"flex-{i}", "role": "flex"} for i in range(3)]
    assert status.flex_roles(state, rows) == {"prefill": 1, "decode": 2, "standby": 0}
    assert [row["serves"] for row in rows] == ["prefill", "decode", "decode"]
    gone = ClusterState(**{**state.__dict__, "router_url": "http://127.0.0.1:1"})
    assert "cannot reach the router" in status.flex_roles(gone, rows)["error"]


def test_the_router_key_is_the_clients_own_else_the_routers_first_admin_key(monkeypatch):
    """The /pdserve/ routes need an admin key when the router has keys (review M7)."""
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_API_KEYS", raising=False)
    monkeypatch.setenv("PDSERVE_API_KEYS", " k1 , k2")
    assert router_api_key() == "k1"
    monkeypatch.setenv("PDSERVE_ADMIN_API_KEYS", "a1,a2")
    assert router_api_key() == "a1"
    monkeypatch.setenv("PDSERVE_API_KEY", "mine")
    assert router_api_key() == "mine"
