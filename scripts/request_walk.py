"""Which of pdserve's files one streamed, disaggregated chat completion runs, in every process
(router, workers, their engines): the count docs/architecture.md quotes.

    python scripts/request_walk.py

It starts `pdserve serve` (1 prefill + 1 decode worker, the tiny test model by default) with a
profile hook in every Python process (a sitecustomize.py on PYTHONPATH, forked children
included) that notes the file of every function called while a shared flag is up. It sends two
warm-up requests, raises the flag for one request (forced onto the disaggregated path), then for
an idle window as long, and prints the files of the request's window, each marked when it also
ran while idle (the router's and workers' background loops: load polls, health). The hook slows
every process, so the cluster takes longer to start than usual.
"""

import argparse
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVING = ("router/", "pdserve/", "kv_transfer/", "prefill_workers/", "decode_workers/")
READY_TIMEOUT_S = 600
DUMP_WAIT_S = 1.0

# Loaded by every Python process of the cluster (PYTHONPATH): notes the files of the functions
# called while the flag's byte is 1, and writes them out when it drops back to 0.
HOOK = r"""
import os, sys, threading, time, mmap
_flag_path, _out = os.environ.get("PDSERVE_WALK_FLAG"), os.environ.get("PDSERVE_WALK_OUT")
if _flag_path and _out:
    _fd = os.open(_flag_path, os.O_RDONLY)
    _flag = mmap.mmap(_fd, 1, prot=mmap.PROT_READ)
    _seen = set()

    def _profile(frame, event, arg):
        if event == "call" and _flag[0]:
            _seen.add(frame.f_code.co_filename)

    def _dump_when_lowered():
        raised = 0
        while True:
            time.sleep(0.02)
            now = _flag[0]
            if raised and not now:
                path = os.path.join(_out, f"{os.getpid()}-{time.monotonic_ns()}.txt")
                with open(path, "w") as out:
                    out.write("\n".join(sorted(_seen)))
                _seen.clear()
            raised = now

    def _start():
        sys.setprofile(_profile)
        threading.setprofile(_profile)
        threading.Thread(target=_dump_when_lowered, daemon=True, name="request-walk").start()

    _start()
    os.register_at_fork(after_in_child=_start)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="the model to serve (default: tiny)")
    parser.add_argument("--port", type=int, default=8765, help="the router's port (default: 8765)")
    parser.add_argument(
        "--cli-module",
        default="pdserve.cli",
        help="the module `python -m` runs as pdserve's CLI (default: pdserve.cli; an older "
        "tree's, to count its files)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pdserve-walk-") as scratch:
        scratch = Path(scratch)
        (scratch / "sitecustomize.py").write_text(HOOK)
        flag_path, out = scratch / "flag", scratch / "out"
        flag_path.write_bytes(b"\0")
        out.mkdir()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(scratch), str(ROOT)]),
            "PDSERVE_WALK_FLAG": str(flag_path),
            "PDSERVE_WALK_OUT": str(out),
        }
        command = [sys.executable, "-m", args.cli_module, "serve", "--model", args.model]
        command += ["--port", str(args.port)]
        print("starting:", " ".join(command), flush=True)
        server = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
        with open(flag_path, "r+b") as flag_file:
            flag = mmap.mmap(flag_file.fileno(), 1)
            try:
                url = f"http://127.0.0.1:{args.port}"
                wait_ready(url, server)
                model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
                for _ in range(2):
                    chat(url, model)
                time.sleep(DUMP_WAIT_S)
                request_files, seconds = window(flag, out, lambda: chat(url, model))
                idle_files, _ = window(flag, out, lambda: time.sleep(seconds))
            finally:
                os.killpg(server.pid, signal.SIGINT)
                server.wait(timeout=60)
    report(request_files, idle_files, args.json)
    return 0


def wait_ready(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"pdserve serve exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"pdserve serve was not ready within {READY_TIMEOUT_S} s")


def chat(url: str, model: str) -> None:
    """One streamed chat completion on the disaggregated path, read to its end."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8,
        "stream": True,
    }
    headers = {"x-pdserve-route": "disaggregated"}
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json=body,
        headers=headers,
        timeout=120,
    ) as response:
        response.raise_for_status()
        for _ in response.iter_lines():
            pass


def window(flag: mmap.mmap, out: Path, action) -> tuple[set[str], float]:
    """The serving files any process ran while `action` ran, and how long it took."""
    for old in out.iterdir():
        old.unlink()
    flag[0] = 1
    started = time.monotonic()
    action()
    seconds = time.monotonic() - started
    flag[0] = 0
    time.sleep(DUMP_WAIT_S)
    files = set()
    for dump in out.iterdir():
        files.update(dump.read_text().splitlines())
    return {relative for f in files if (relative := serving(f))}, seconds


def serving(filename: str) -> str | None:
    try:
        relative = Path(filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    return relative if relative.startswith(SERVING) else None


def report(request_files: set[str], idle_files: set[str], json_path: Path | None) -> None:
    for name in sorted(request_files):
        print(f"  {name}{'   (also idle)' if name in idle_files else ''}")
    only = request_files - idle_files
    print(
        f"files run during the request: {len(request_files)} "
        f"({len(only)} not run while idle); while idle: {len(idle_files)}"
    )
    if json_path is not None:
        json_path.write_text(
            json.dumps({"request": sorted(request_files), "idle": sorted(idle_files)}, indent=1)
        )


if __name__ == "__main__":
    sys.exit(main())
