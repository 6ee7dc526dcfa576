"""pdserve/cluster/serve._listen: the router's socket is bound and listening before any worker
starts,
so no worker can be handed its port in the meantime (loopback only)."""

import socket

import pytest

from pdserve.cluster.serve import _listen


def test_the_routers_port_is_held_from_the_start():
    listener = _listen("127.0.0.1", 0)
    try:
        port = listener.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepted into the backlog before any server runs
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            _listen("127.0.0.1", port)
    finally:
        listener.close()
