"""pdserve/cluster/local_workers.core_shares: how `pdserve serve --cpu-binding split` divides a
host's
cores among its workers, in the form vLLM's VLLM_CPU_OMP_THREADS_BIND reads."""

from pdserve.cluster.local_workers import core_shares


def test_two_workers_on_two_cores_get_one_each():
    assert core_shares([1, 1], [0, 1]) == ["0", "1"]


def test_shares_are_equal_and_in_order():
    assert core_shares([1, 1, 1], [0, 1, 2, 3, 4, 5, 6]) == ["0,1", "2,3", "4,5"]


def test_a_tensor_parallel_worker_gets_one_list_per_rank():
    assert core_shares([2, 1], [0, 1, 2, 3, 4, 5]) == ["0,1|2,3", "4,5"]


def test_more_ranks_than_cores_share_them_in_turn():
    assert core_shares([1, 1, 1], [4, 5]) == ["4", "5", "4"]
