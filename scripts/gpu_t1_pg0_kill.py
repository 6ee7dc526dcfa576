"""GPU check T1 (review §3.1): a pdserve NCCL group whose operation times out, beside a vLLM-like
world group (process group 0), leaves the process alive.

    python3 scripts/gpu_t1_pg0_kill.py                   # both variants at once, ~80 s
    python3 scripts/gpu_t1_pg0_kill.py --json t1.json --alive-s 60

Each variant is a process of its own, on GPU 0:

1. its environment is the one a pdserve GPU worker starts with (`fixed`:
   pdserve/worker/gpu_environment.nccl_environment, TORCH_NCCL_DUMP_ON_TIMEOUT=0) or torch's
   defaults (`unfixed`); both with TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=10 and
   TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=2000, so that an abort by process group 0's monitor
   comes ~20 s after the timeout instead of 8 minutes;
2. it makes process group 0 as vLLM 0.32 does (`init_process_group("cpu:gloo,cuda:nccl",
   world_size=1, device_id=cuda:0)`, vllm/distributed/parallel_state.py) and runs a collective;
3. it makes a 1-rank group over a store of its own exactly as pdserve makes its KV groups
   (kv_transfer/nccl_transport.nccl_backend: non-blocking, CleanUpOnly, no monitor of its own,
   torch's timeout WATCHDOG_FACTOR times pdserve's deadline of DEADLINE_S);
4. it queues SLEEP_S of GPU work (`torch.cuda._sleep`) on a dedicated current stream (vLLM's
   forward runs on one) and an all-reduce on that group behind it, and waits for it through
   pdserve's own PairGroup: it fails at pdserve's deadline, the group aborted first. The aborted
   operation stays queued behind the sleep past torch's own timeout, so torch's watchdog does
   find it timed out and raises the flag every group of the process shares: the worst case,
   as when a dead peer's error reaches the watchdog before pdserve does;
5. it drops the group (PairGroup.close) while torch's watchdog sleeps after the error, and
   measures the longest time its Python threads were held;
6. it stays ALIVE_S and prints one JSON line.

The check passes when `fixed` is alive, failed within its deadline, and no thread was held
long. `unfixed` is reported: dead with torch's "Terminating the process after attempting to dump
debug info" reproduces the review's reading of torch (its §3.1); alive means this torch does not
do that (the fix is then harmless). Torch only (no pydantic, numpy or vLLM); the GPU checks run
it as tests/gpu/test_pg0_survives.py, started before the first check and judged last:

    Pg0Check(device).start(); ...; .result() -> str; .stop()  # kills what still runs
"""

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
WATCHDOG_FACTOR = 2.0  # kv_transfer/nccl_transport.WATCHDOG_FACTOR (not imported: no grpc here)
ALIVE_S = 60.0  # how long after the failure the process must still be alive
DEADLINE_S = 2.0  # pdserve's deadline for the operation (torch's watchdog: twice that)
SLEEP_S = 6.0  # GPU work queued before the operation: past torch's timeout (4 s), well under
# the heartbeat monitor's 10 s (a stall that long would be vLLM's own hang kill, not this)
HOLD_LIMIT_S = 1.0  # longest a Python thread may be held (by the group's drop, a dump)
VARIANTS = ("fixed", "unfixed")
TERMINATED = "Terminating the process after attempting to dump debug info"
TEST_ENV = {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "10", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000"}

CHILD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from datetime import timedelta
    variant, alive_s, deadline_s, sleep_s = sys.argv[1], *map(float, sys.argv[2:5])
    sys.path.insert(0, os.getcwd())
    if variant == "fixed":  # the environment a pdserve GPU worker starts with
        from pdserve.worker.gpu_environment import nccl_environment
        nccl_environment(has_connector=True, cpu=False)
    import torch
    import torch.distributed as dist
    from kv_transfer.nccl_transport import PairGroup, nccl_backend
    from kv_transfer.transport import ChannelError

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    held = [0.0]
    def ticking():  # the longest gap between ticks: how long Python threads were held
        last = time.monotonic()
        while True:
            time.sleep(0.005)
            now = time.monotonic()
            held[0] = max(held[0], now - last)
            last = now
    threading.Thread(target=ticking, daemon=True).start()

    world = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
    dist.init_process_group(  # process group 0, as vLLM makes it
        "cpu:gloo,cuda:nccl", store=world, rank=0, world_size=1, device_id=device,
        timeout=timedelta(minutes=10),
    )
    ones = torch.ones(4, device=device)
    dist.all_reduce(ones)
    torch.cuda.synchronize()
    kv_store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60),
                             wait_for_workers=False)  # a KV group's store is its own
    backend = nccl_backend(dist.PrefixStore("pdserve-kv", kv_store), 0, 1, device, deadline_s)
    group = PairGroup.over(backend, 0, deadline_s, polls=True, device=device)
    torch.cuda.set_stream(torch.cuda.Stream(device))  # vLLM's forward runs on its own stream
    held[0] = 0.0
    rate = getattr(torch.cuda.get_device_properties(device), "clock_rate", 1_500_000)  # kHz
    torch.cuda._sleep(int(sleep_s * rate * 1000))
    data = torch.ones(1 << 20, device=device)
    started = time.monotonic()
    outcome = "completed (no timeout: the check is void)"
    try:
        group.finish(group.post(lambda g: g.allreduce([data]), "T1 all-reduce"))
    except ChannelError as error:
        outcome = f"failed: {error}"
    failed_after = time.monotonic() - started
    closing = time.monotonic()
    group.close()  # while torch's watchdog may sleep after the error
    close_s = time.monotonic() - closing
    time.sleep(max(0.0, alive_s - (time.monotonic() - started)))
    print(json.dumps({
        "variant": variant, "alive": True, "outcome": outcome[:300],
        "failed_after_s": round(failed_after, 2), "close_s": round(close_s, 3),
        "longest_hold_s": round(held[0], 3),
        "kv_group_uid": getattr(backend, "uid", None),  # process group 0 is vLLM's
        "env": {k: v for k, v in os.environ.items() if k.startswith("TORCH_NCCL")},
    }), flush=True)
    os._exit(0)  # the aborted groups' teardown is not what is checked
    """
)


class Unavailable(Exception):
    """The check cannot run here."""


class Pg0Check:
    """Both variants' processes, started together (`start`: the GPU checks do so first, so they
    run while the other checks do), judged once both are done (`result`), and killed if the run
    ends before that (`stop`)."""

    def __init__(self, device: torch.device, alive_s: float = ALIVE_S) -> None:
        self.device = device
        self.alive_s = alive_s
        self.processes: dict[str, subprocess.Popen] = {}
        self.found: dict[str, dict] | None = None

    def start(self) -> None:
        if self.device.type != "cuda" or self.processes:
            return
        env = {**os.environ, **TEST_ENV, "PYTHONUNBUFFERED": "1"}
        for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING"):
            env.pop(name, None)  # torch's defaults, unless the variant's start sets them
        for variant in VARIANTS:
            self.processes[variant] = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    variant,
                    str(self.alive_s),
                    str(DEADLINE_S),
                    str(SLEEP_S),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

    def outcomes(self) -> dict[str, dict]:
        """Each variant's: its JSON line (alive) or how it died."""
        if self.found is not None:
            return self.found
        self.start()
        found = self.found = {}
        for variant, process in self.processes.items():
            try:
                out, err = process.communicate(timeout=self.alive_s + 120)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
                found[variant] = {"alive": False, "died": "hung (killed)", "tail": err[-600:]}
                continue
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if process.returncode == 0 and lines:
                found[variant] = json.loads(lines[-1])
            else:
                how = f"exit {process.returncode}"
                if TERMINATED in err:
                    how += f' ("{TERMINATED}")'
                found[variant] = {"alive": False, "died": how, "tail": err[-600:]}
        return found

    def stop(self) -> None:
        """Kill the variants' processes still running (their pipes closed too)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
            process.communicate(timeout=30)

    def result(self) -> str:
        if self.device.type != "cuda":
            raise Unavailable(
                "CUDA only: torch's ProcessGroupNCCL watchdog and heartbeat monitor (review §3.1)"
            )
        found = self.outcomes()
        fixed, unfixed = found["fixed"], found["unfixed"]
        if not fixed["alive"]:
            raise AssertionError(
                f"with the worker's environment the process died: {fixed['died']}: "
                f"{fixed['tail'][-300:]}"
            )
        if not fixed["outcome"].startswith("failed"):
            raise AssertionError(f"the operation did not time out: {fixed['outcome']}")
        # At the deadline; the group's abort itself is bounded by torch's timeout for the group.
        latest = DEADLINE_S * (1 + WATCHDOG_FACTOR) + 1.5
        if not DEADLINE_S <= fixed["failed_after_s"] <= latest:
            raise AssertionError(f"failed after {fixed['failed_after_s']} s, not at the deadline")
        if max(fixed["longest_hold_s"], fixed["close_s"]) > HOLD_LIMIT_S:
            raise AssertionError(
                f"a thread was held {fixed['longest_hold_s']} s (close took {fixed['close_s']} s)"
            )
        reproduced = (
            f"died: {unfixed['died']} (review §3.1 reproduced)"
            if not unfixed["alive"]
            else "alive too (this torch's monitor ignored the failure)"
        )
        return (
            f"fixed: alive {self.alive_s:g} s after its operation failed at the "
            f"{fixed['failed_after_s']} s deadline, longest hold {fixed['longest_hold_s']} s; "
            f"unfixed: {reproduced}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--alive-s", type=float, default=ALIVE_S)
    parser.add_argument("--json", type=Path, help="write both variants' outcomes here")
    args = parser.parse_args()
    check = Pg0Check(torch.device(args.device), alive_s=args.alive_s)
    started = time.monotonic()
    try:
        status, detail = "PASS", check.result()
    except Unavailable as why:
        status, detail = "SKIP", str(why)
    except AssertionError as error:
        status, detail = "FAIL", str(error)
    print(f"{status}  T1 process group 0 survives a KV group's failure  {detail}")
    if args.json:
        report = {"status": status, "detail": detail, "seconds": time.monotonic() - started}
        if check.processes:
            report["variants"] = check.outcomes()
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
