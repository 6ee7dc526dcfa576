"""pdserve/cluster/local_workers: how `pdserve serve --cpu-binding split` divides a host's cores
among its workers, in the form vLLM's VLLM_CPU_OMP_THREADS_BIND reads (core_shares), and the
OpenMP settings a started worker gets (thread count, wait policy)."""

from pdserve.cluster import local_workers
from pdserve.cluster.local_workers import core_shares, omp_wait_policy, start_worker
from pdserve.settings.worker import WorkerSettings


def test_two_workers_on_two_cores_get_one_each():
    assert core_shares([1, 1], [0, 1]) == ["0", "1"]


def test_shares_are_equal_and_in_order():
    assert core_shares([1, 1, 1], [0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]


def test_a_tensor_parallel_worker_gets_one_list_per_rank():
    assert core_shares([2, 1], [0, 1, 2, 3, 4, 5]) == ["0,1|2,3", "4,5"]


def test_more_ranks_than_cores_share_them_in_turn():
    assert core_shares([1, 1, 1], [4, 5]) == ["4", "5", "4"]


class FakeSpawn:
    """Stands in for processes.spawn: records each command's environment, starts nothing."""

    def __init__(self) -> None:
        self.envs: list[dict[str, str]] = []

    def __call__(self, command, log_path, env=None):
        self.envs.append(env)
        return object()


def test_workers_that_split_the_cores_wait_passively_and_a_lone_one_spins(monkeypatch):
    monkeypatch.setattr(local_workers.os, "cpu_count", lambda: 4)
    assert omp_wait_policy(2) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_wait_policy(1) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_wait_policy(4) == {}  # one worker has every core


def test_a_started_worker_gets_the_wait_policy_unless_its_user_set_one(monkeypatch, tmp_path):
    monkeypatch.setattr(local_workers.os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    spawned = FakeSpawn()
    monkeypatch.setattr(local_workers, "spawn", spawned)
    settings = WorkerSettings(role="decode", port=1)
    start_worker(settings, tmp_path, threads=1)
    start_worker(settings, tmp_path, threads=2)
    start_worker(settings, tmp_path, threads=1, env={"OMP_WAIT_POLICY": "ACTIVE"})
    policies = [env.get("OMP_WAIT_POLICY") for env in spawned.envs]
    assert policies == ["PASSIVE", None, "ACTIVE"]
    assert [env["OMP_NUM_THREADS"] for env in spawned.envs] == ["1", "2", "1"]
