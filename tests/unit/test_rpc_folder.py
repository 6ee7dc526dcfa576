"""pdserve/worker/rpc_folder.py: a worker's engine gets a socket folder of its own, which goes
with the sockets vLLM left in it; a VLLM_RPC_BASE_PATH the user set is left alone."""

import os
import socket
import tempfile
from pathlib import Path

from pdserve.worker import rpc_folder


def test_the_engine_gets_a_folder_of_its_own_that_goes_with_its_sockets(monkeypatch):
    monkeypatch.delenv(rpc_folder.RPC_BASE_PATH_ENV, raising=False)
    folder = rpc_folder.make_private()
    try:
        assert folder.is_dir() and folder.parent == Path(tempfile.gettempdir())
        assert folder.name.startswith(rpc_folder.PREFIX)
        assert os.environ[rpc_folder.RPC_BASE_PATH_ENV] == str(folder)
        assert rpc_folder.make_private() is None  # a second call: the folder is set already
        with socket.socket(socket.AF_UNIX) as left:  # what a killed engine leaves: a bound name
            left.bind(str(folder / "6949012b-ecf5-4bfb-b3be-8acf70b5f2c1"))
        rpc_folder.remove(folder)
        assert not folder.exists()
    finally:
        rpc_folder.remove(folder)


def test_a_folder_the_user_chose_is_theirs(monkeypatch, tmp_path):
    monkeypatch.setenv(rpc_folder.RPC_BASE_PATH_ENV, str(tmp_path))
    assert rpc_folder.make_private() is None
    assert os.environ[rpc_folder.RPC_BASE_PATH_ENV] == str(tmp_path)
    rpc_folder.remove(None)
    assert tmp_path.is_dir()
