"""Which nodes a GPU worker pod may run on: those carrying its pool's GPU (the cluster file's
`gpu_type`, by the product label NVIDIA's GPU feature discovery sets, which the GPU Operator
installs), tolerating the GPU nodes' usual taint. Clusters labelled otherwise (GKE's
cloud.google.com/gke-accelerator, a node pool of one's own) replace both with `pdserve k8s
render --node-selector ... --toleration ...`."""

from dataclasses import dataclass

GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
# gpu_type -> the product as GPU feature discovery writes it (nvidia-smi's name, dashes for
# spaces). A100-80GB is the SXM4 card; the PCIe one is NVIDIA-A100-80GB-PCIe.
GPU_PRODUCTS = {
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-SXM": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "L40S": "NVIDIA-L40S",
}


@dataclass(frozen=True)
class Toleration:
    """`KEY[=VALUE][:EFFECT]`, as `kubectl taint` spells a taint: without a value any value of
    the key is tolerated, without an effect every effect."""

    key: str
    value: str = ""
    effect: str = ""

    @classmethod
    def parse(cls, text: str) -> "Toleration":
        taint, _, effect = text.partition(":")
        key, _, value = taint.partition("=")
        if not key or effect not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ValueError(
                f"expected KEY[=VALUE][:NoSchedule|PreferNoSchedule|NoExecute], got {text!r}"
            )
        return cls(key, value, effect)

    def manifest(self) -> dict:
        toleration = {"key": self.key, "operator": "Equal" if self.value else "Exists"}
        if self.value:
            toleration["value"] = self.value
        if self.effect:
            toleration["effect"] = self.effect
        return toleration


GPU_TAINT = Toleration("nvidia.com/gpu", effect="NoSchedule")


def gpu_placement(
    gpu_type: str, node_selector: dict[str, str] | None, tolerations: tuple[Toleration, ...] | None
) -> dict:
    """A GPU pod spec's nodeSelector and tolerations: the given ones, else the pool's GPU's."""
    if node_selector is None:
        node_selector = {GPU_PRODUCT_LABEL: GPU_PRODUCTS[gpu_type]}
    if tolerations is None:
        tolerations = (GPU_TAINT,)
    placement = {"tolerations": [toleration.manifest() for toleration in tolerations]}
    if node_selector:
        placement["nodeSelector"] = node_selector
    return placement
