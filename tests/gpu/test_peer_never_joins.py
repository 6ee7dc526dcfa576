"""A pairwise group (kv_transfer/nccl_transport.PairGroup) whose peer never joins the store
("store") or joins it and never makes its communicator ("communicator": on CUDA, NCCL's own
creation must be bounded) raises within its deadline, in a process of its own: it does not hang,
and torch's watchdog does not abort the process afterwards (it stays past the watchdog's timeout
and exits cleanly)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT_S = 3.0  # the group's deadline
PEER_NEVER_JOINS = textwrap.dedent(
    """
    import sys, threading, time, torch
    from datetime import timedelta
    from torch.distributed import TCPStore
    from kv_transfer.nccl_transport import WATCHDOG_FACTOR, PairGroup, rendezvous

    backend, timeout_s, case = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")

    def store(port=0, master=True):
        return TCPStore("127.0.0.1", port, world_size=2, is_master=master,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    master = store()
    if case == "communicator":  # the peer checks in on the store, then makes no communicator
        peer = store(master.port, master=False)
        threading.Thread(target=rendezvous, args=(peer, 1, timeout_s), daemon=True).start()
    started = time.monotonic()
    try:
        group = PairGroup(master, backend, 0, "127.0.0.1", device, timeout_s)
        group.send(torch.ones(1024, device=device))
        print("no error: the send completed with no peer")
    except Exception as error:
        took = time.monotonic() - started
        alive = ""
        if backend == "nccl":  # stay until torch's watchdog would have fired (gloo has none)
            time.sleep(max(0.0, timeout_s * WATCHDOG_FACTOR + 2 - took))
            alive = ", alive past the watchdog's timeout"
        print(f"raised after {took:.1f} s{alive}: {type(error).__name__}: {error}")
    """
)


def test_a_group_whose_peer_never_joins_raises_within_its_deadline(device, record_property):
    """Both cases at once, each in its own process (each mostly waits out its deadline)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    limit = 6 * PEER_TIMEOUT_S + 30  # the process start, imports and the watchdog wait included
    processes = {
        case: subprocess.Popen(
            [sys.executable, "-c", PEER_NEVER_JOINS, backend, str(PEER_TIMEOUT_S), case],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case in ("store", "communicator")
    }
    try:
        said = {case: last_line(process, limit) for case, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=30)
    for case, (code, line) in said.items():
        assert code == 0, f"{backend}, peer never joins the {case}: died (exit {code}): {line}"
        assert line.startswith("raised after"), f"{backend}, peer never joins the {case}: {line}"
        seconds = float(line.split()[2])
        assert seconds <= 2 * PEER_TIMEOUT_S + 5, f"{backend}, {case}: raised after {seconds:g} s"
    outcomes = [f"peer never joins the {case}: {line[:150]}" for case, (_, line) in said.items()]
    record_property("detail", f"{backend}, deadline {PEER_TIMEOUT_S:g} s: " + "; ".join(outcomes))


def last_line(process: subprocess.Popen, limit_s: float) -> tuple[int | None, str]:
    """The process's exit code and last line of output (of its errors if it printed none);
    (None, "hung ...") if it runs past `limit_s`."""
    try:
        out, err = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        return None, f"hung past {limit_s:g} s (deadline {PEER_TIMEOUT_S:g} s)"
    return process.returncode, (out.strip().splitlines()[-1:] or [err.strip()[-300:]])[0]
