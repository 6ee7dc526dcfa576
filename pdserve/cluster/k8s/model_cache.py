"""The model cache: a volume every pdserve pod mounts at /models, filled once before any pod loads
the model.

- The claim: ReadWriteMany of `--storage-class` (pods on several nodes read it), sized from the
  checkpoint; on a CPU cluster (a smoke test on one node) ReadWriteOnce.
- A Job fills it (`hf download` of a Hugging Face id with HF_TOKEN from `--hf-token-secret`, or
  `pdserve model path` for pdserve's own models) and writes a marker last; each pod that loads
  the model waits for that marker in an init container. So no worker downloads on its own, races
  another, or crash-loops on a gated model, and a half download never looks finished. The Job
  alone holds the hub token and reaches the internet; the pods that load the model read the
  cache with the hub offline.
- The time it may take: the workers' start-up probe and the Deployments' progress deadline are
  sized from the checkpoint's bytes, so a cold 70B start of many minutes is not a failure.

A model given as a folder is not fetched: it must already be in the image or on the volume.
"""

import hashlib
import json
import math
import shlex
from dataclasses import dataclass

from pdserve.cluster.k8s.base import network_policy
from pdserve.cluster.k8s.objects import NO_ESCALATION, POD_SECURITY, labels, metadata
from pdserve.cluster.k8s.options import RenderOptions
from pdserve.cluster.placement import model_shape
from pdserve.model_store.store import MODEL_NAMES, is_hub_id
from pdserve.planner.capacity import GIB, weight_bytes
from pdserve.planner.model_spec import hub_checkpoint
from pdserve.settings.cluster_file import ClusterFile

MOUNT = "/models"
COMPONENT = "model-fetch"  # the fetch Job's pods
CLAIM = "pdserve-models"
READY = f"{MOUNT}/ready"  # one marker per model, written by the fetch Job once it is complete
# Big Llama repositories also carry Meta's original checkpoint (as large again): vLLM reads
# the safetensors only.
SKIPPED_FILES = "original/*"

# Time, cautiously: a hub download sustained at 100 MB/s; a worker reading the weights from
# network storage at 250 MB/s; then vLLM's start (KV cache, CUDA graphs, compilation).
DOWNLOAD_BYTES_PER_S = 100e6
LOAD_BYTES_PER_S = 250e6
ENGINE_START_S = 300
UNKNOWN_DOWNLOAD_S = 1800  # a model whose size is not known here (a folder, a custom id)
MIN_START_S = 600
PROBE_PERIOD_S = 10
CLAIM_HEADROOM = 1.25  # tokenizer, configs, a second revision
UNKNOWN_CLAIM = {"gpu": "200Gi", "cpu": "10Gi"}


@dataclass(frozen=True)
class StartBudget:
    """How long a cold start may take, in seconds: the fetch Job (before any worker starts),
    then a worker from its container's start to ready."""

    download_s: int
    start_s: int

    @property
    def startup_failures(self) -> int:
        """The start-up probe's failureThreshold at PROBE_PERIOD_S."""
        return math.ceil(self.start_s / PROBE_PERIOD_S)

    @property
    def progress_deadline_s(self) -> int:
        """A Deployment's pods wait for the download, then start."""
        return self.download_s + self.start_s


def checkpoint_bytes(config: ClusterFile) -> int | None:
    """The checkpoint's size where the file names a preset or a known id; None otherwise (a
    folder's size would mean reading, or making, it here)."""
    if not (config.model.preset or hub_checkpoint(config.model.path)):
        return None
    return weight_bytes(model_shape(config))


def start_budget(config: ClusterFile) -> StartBudget:
    size = checkpoint_bytes(config)
    if size is None:
        return StartBudget(UNKNOWN_DOWNLOAD_S, MIN_START_S)
    start = max(MIN_START_S, math.ceil(size / LOAD_BYTES_PER_S) + ENGINE_START_S)
    return StartBudget(math.ceil(size / DOWNLOAD_BYTES_PER_S), start)


CACHE_ENV = [
    {"name": "PDSERVE_CACHE", "value": f"{MOUNT}/pdserve"},
    {"name": "HF_HOME", "value": f"{MOUNT}/huggingface"},
]


def cache_env() -> list[dict]:
    """What a pod that reads the filled cache (a worker, a router, a Ray pod) needs: where
    pdserve's and Hugging Face's caches live, and the hub offline. Never the hub token: only the
    fetch Job downloads, and these pods reach no hub (their egress is denied: base.py)."""
    return [*CACHE_ENV, {"name": "HF_HUB_OFFLINE", "value": "1"}]


def fetch_env(options: RenderOptions) -> list[dict]:
    """The fetch Job's: the caches, and the hub token when there is one (`--hf-token-secret`)."""
    env = list(CACHE_ENV)
    if options.hf_token_secret:
        token = {"name": options.hf_token_secret, "key": "token", "optional": False}
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": token}})
    return env


def models_volume() -> dict:
    return {"name": "models", "persistentVolumeClaim": {"claimName": CLAIM}}


def models_mount() -> dict:
    return {"name": "models", "mountPath": MOUNT}


def model_cache_claim(config: ClusterFile, options: RenderOptions, gpus: bool) -> dict:
    size = checkpoint_bytes(config)
    if options.model_cache_size:
        storage = options.model_cache_size
    elif size is None:
        storage = UNKNOWN_CLAIM["gpu" if gpus else "cpu"]
    else:
        storage = f"{math.ceil(size * CLAIM_HEADROOM / GIB) + 10}Gi"
    spec = {
        "accessModes": ["ReadWriteMany" if gpus else "ReadWriteOnce"],
        "resources": {"requests": {"storage": storage}},
    }
    if options.storage_class:
        spec["storageClassName"] = options.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": metadata(CLAIM, "model-cache"),
        "spec": spec,
    }


def fetch_command(model: str) -> list[str] | None:
    if model in MODEL_NAMES:
        return ["pdserve", "model", "path", model]
    if is_hub_id(model):
        return ["hf", "download", model, "--exclude", SKIPPED_FILES]
    return None


def _marker(model: str) -> str:
    return f"{READY}/{model.replace('/', '--')}"


def fetch_job(config: ClusterFile, options: RenderOptions) -> dict | None:
    """The Job that fills the cache; None for a folder. Its name carries a digest of its pod, so
    a new model or image is a new Job (a Job's pod template cannot be changed in place)."""
    model = config.model.path
    command = fetch_command(model)
    if command is None:
        return None
    script = f"{shlex.join(command)} && mkdir -p {READY} && touch {shlex.quote(_marker(model))}"
    pod = {
        "restartPolicy": "OnFailure",  # `hf download` resumes what an earlier try left
        **POD_SECURITY,
        "containers": [
            {
                "name": "fetch",
                "image": options.image("cpu"),
                "command": ["sh", "-c", script],
                "env": fetch_env(options),
                "resources": {
                    "requests": {"cpu": "1", "memory": "2Gi"},
                    "limits": {"memory": "4Gi"},
                },
                "securityContext": NO_ESCALATION,
                "volumeMounts": [models_mount()],
            }
        ],
        "volumes": [models_volume()],
    }
    digest = hashlib.sha256(json.dumps(pod, sort_keys=True).encode()).hexdigest()[:8]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata(f"pdserve-model-fetch-{digest}", COMPONENT),
        "spec": {
            "backoffLimit": 6,
            "activeDeadlineSeconds": 3 * start_budget(config).download_s,
            "template": {"metadata": {"labels": labels(COMPONENT)}, "spec": pod},
        },
    }


def fetch_egress() -> dict:
    """The fetch Job downloads from the internet (the hub, PyPI, a proxy): it may reach any
    address but the link-local ones (the cloud's metadata service: 169.254.169.254,
    fd00:ec2::254), which would hand it the node's credentials. It is in no flow of the
    namespace's policies: nothing of pdserve's admits it (base.py)."""
    anywhere = [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16"]}},
        {"ipBlock": {"cidr": "::/0", "except": ["fe80::/10", "fd00:ec2::254/128"]}},
    ]
    return network_policy(
        "pdserve-model-fetch",
        {
            "podSelector": {"matchLabels": labels(COMPONENT)},
            "policyTypes": ["Egress"],
            "egress": [{"to": anywhere}],
        },
    )


def wait_for_model(config: ClusterFile, image: str) -> list[dict]:
    """The init container of a pod that loads the model: it waits for the fetch Job's marker
    (none for a folder, which no Job fills)."""
    model = config.model.path
    if fetch_command(model) is None:
        return []
    marker = shlex.quote(_marker(model))
    script = (
        f"until [ -e {marker} ]; do echo 'waiting for the pdserve-model-fetch Job to put "
        f"{model} in the model cache'; sleep {PROBE_PERIOD_S}; done"
    )
    return [
        {
            "name": "wait-for-model",
            "image": image,
            "command": ["sh", "-c", script],
            "resources": {
                "requests": {"cpu": "10m", "memory": "16Mi"},
                "limits": {"memory": "64Mi"},
            },
            "securityContext": NO_ESCALATION,
            "volumeMounts": [models_mount()],
        }
    ]
