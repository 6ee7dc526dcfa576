"""The shm sender tells the cluster secret to its own user's receiver only (security review
2026-12, M4): an abstract socket's name is open to every local user, who could bind it while
the decode worker restarts; the sender checks SO_PEERCRED right after connecting, before its
hello (which carries the secret) or any KV. A real receiver on 127.0.0.1; SO_PEERCRED made to
name another user."""

import socket

import pytest

from kv_transfer.kv_receiver import KvReceiver
from kv_transfer.shm_transport import ShmChannel
from kv_transfer.transport import ChannelError
from pdserve.settings.cluster_secret import SECRET_ENV
from tests.unit.kv_endpoints import CONSUMER, OTHER_UID, another_users_peer


def test_the_shm_sender_says_nothing_to_a_receiver_of_another_user(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    try:
        another_users_peer(monkeypatch)
        sent = []
        real_sendall = socket.socket.sendall

        def sendall(sock, data, *flags):
            sent.append(bytes(data))
            return real_sendall(sock, data, *flags)

        monkeypatch.setattr(socket.socket, "sendall", sendall)
        with pytest.raises(ChannelError, match=f"uid {OTHER_UID}"):
            ShmChannel(address, CONSUMER)
        assert sent == []  # no hello, no secret
    finally:
        receiver.stop()


def test_the_shm_sender_still_talks_to_its_own_users_receiver(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "the cluster's")
    receiver = KvReceiver(CONSUMER)
    address = f"127.0.0.1:{receiver.start('127.0.0.1', 0)}"
    try:
        ShmChannel(address, CONSUMER).close()
    finally:
        receiver.stop()
