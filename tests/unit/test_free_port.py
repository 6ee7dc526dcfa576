"""free_port (pdserve/worker/processes.py): ports a worker binds later, drawn where no socket
bound to port 0 can be handed them meanwhile, and skipped when taken."""

import socket

from pdserve.worker import processes
from pdserve.worker.processes import free_port


def test_ports_come_from_below_the_ephemeral_range_with_the_next_ones_free():
    start = processes._ephemeral_ports_start()
    for count in (1, 2, 4):
        port = free_port(count=count)
        assert processes.FIRST_CHOSEN_PORT <= port and port + count <= start
        assert port + count <= processes.NODE_PORTS_START
        for offset in range(count):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port + offset))  # free: binds


class FakeDraws:
    """Stands in for the random draw: hands out the given ports in turn."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports

    def randint(self, first: int, last: int) -> int:
        port = self.ports.pop(0)
        assert first <= port <= last
        return port


def test_a_taken_port_or_a_taken_next_port_is_skipped(monkeypatch):
    port, spare = free_port() + 1, free_port(count=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        monkeypatch.setattr(processes, "_random", FakeDraws([port, port - 1, spare]))
        # port is taken; port - 1 may be free, but the port after it is not
        assert free_port(count=2) == spare
