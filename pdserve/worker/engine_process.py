"""How a worker's vLLM engine process starts, and when the worker may open its gRPC port.

AsyncLLM runs its engine core in a child process, forked where it can be (vLLM's default, so on
a GPU host) and spawned where it must be: vLLM's CPU platform asks for spawn because it binds
each tensor-parallel rank's OpenMP threads through the environment a fresh process reads (with
no binding, as `serve` gives TP workers that the host's cores cannot each give a share, the
ranks are forked too). A
forked child inherits what the worker holds, and a gRPC server's threads and polling state do
not survive a fork (the engine core then serves and dials KV over gRPC of its own). So a worker
whose engine forks opens its gRPC port only once the fork has happened (`EngineProcessStart`),
and one whose engine spawns opens it at once.

At TP 1 on CPU the engine core runs the model itself (`model_in_the_engine_core` in
pdserve/worker/engine.py) and nothing in it needs a fresh process: it is forked, as on a GPU,
which spares each worker a second import of torch and vLLM (~10 s of a core here). Its OpenMP
binding is set in the worker's own environment before torch loads (`bind_openmp_threads`),
which the forked engine core keeps.
"""

import asyncio
import os
import threading

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"  # vLLM's: fork or spawn
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"  # vLLM's on CPU: each rank's cores ("0-3|4-7")


def start_method(cpu: bool, tensor_parallel_size: int, chosen: str | None, bind: str) -> str:
    """How the engine's processes start: as the user chose (VLLM_WORKER_MULTIPROC_METHOD, read
    before vLLM's CPU platform sets its own); else spawned for tensor-parallel ranks on CPU that
    vLLM binds to cores (`bind`, VLLM_CPU_OMP_THREADS_BIND: "0,1|2,3" or auto), which it does
    through the environment a fresh process reads; forked otherwise, which spares each rank an
    import of torch and vLLM (~10 s of a core here). vLLM may still spawn where it must (CUDA
    already initialised, inside a Ray actor)."""
    if chosen:
        return chosen
    return "spawn" if cpu and tensor_parallel_size > 1 and bind != "nobind" else "fork"


def bind_openmp_threads() -> None:
    """A single core list in VLLM_CPU_OMP_THREADS_BIND (a TP-1 worker's share of the host,
    from `pdserve serve --cpu-binding split`) as the OpenMP variables vLLM would give its
    model's process. They must be set before torch loads OpenMP, which reads them once: the
    engine core, forked later, keeps what this process read. Lists for several ranks
    ("0,1|2,3") are vLLM's to apply (it spawns those ranks); nobind and auto do nothing."""
    bind = os.environ.get(OMP_BIND_ENV, "nobind")
    if bind in ("nobind", "auto") or "|" in bind:
        return
    os.environ.update(openmp_binding(core_ids(bind)))


def openmp_binding(cores: list[int]) -> dict[str, str]:
    """The OpenMP variables that put a process's compute threads on `cores`, one each."""
    return {
        "OMP_NUM_THREADS": str(len(cores)),
        "OMP_PLACES": "{" + ",".join(str(core) for core in cores) + "}",
        "OMP_PROC_BIND": "true",
    }


def core_ids(spec: str) -> list[int]:
    """The cores of a list such as "0-3,6" (vLLM's notation)."""
    cores = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


class EngineProcessStart:
    """Set once this process has forked (vLLM starting the engine core), or once it is known
    that the engine's process will not be forked, or that the engine's start is over."""

    def __init__(self) -> None:
        self._done = threading.Event()
        os.register_at_fork(after_in_parent=self._done.set)

    def no_fork_coming(self) -> None:
        self._done.set()

    async def wait(self, starting: asyncio.Task) -> None:
        """Until the engine's process has started, or `starting` (the engine's start) ended."""
        waiting = asyncio.create_task(asyncio.to_thread(self._done.wait))
        await asyncio.wait({waiting, starting}, return_when=asyncio.FIRST_COMPLETED)
        self._done.set()  # the thread waiting on it ends too
        await waiting
