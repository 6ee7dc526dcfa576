"""The cluster file `pdserve plan --write-cluster` writes: the recommended pools in the YAML
layout pdserve/settings/cluster_file.py loads, so a plan can be brought up as it was simulated."""

from pathlib import Path

import yaml

from pdserve.planner.model_spec import HUB_CHECKPOINTS, MODEL_PRESETS
from pdserve.planner.search import Candidate


def cluster_document(
    candidate: Candidate,
    model: str,
    dtype: str,
    gpu_type: str,
    kv_cache_gib: dict[str, int] | None = None,
) -> dict:
    """`model` is a planner preset, a known checkpoint id or a config.json path: a preset stays
    as `model.preset` (the head layout `up` checks) and as a placeholder `model.path` to replace
    with the weights' location; a known id is the path (`up` knows its shape); a config.json's
    folder is the path. `dtype` "auto" means the model's own.
    `kv_cache_gib` (role -> GiB per GPU) sizes each pool's KV cache; a pool not in it takes the
    engine's default. Colocated is a decode pool with no prefill replica: its workers prefill
    their own prompts."""
    kv = kv_cache_gib or {}
    is_preset = model in MODEL_PRESETS
    named = is_preset or model in HUB_CHECKPOINTS or Path(model).is_dir()
    folder = model if named else str(Path(model).parent)
    return {
        "name": "planned",
        "model": {"path": folder, "dtype": dtype, **({"preset": model} if is_preset else {})},
        "engine": {},
        "prefill": {
            "replicas": candidate.prefill_replicas,
            "tensor_parallel_size": candidate.prefill_tp,
            "gpu_type": gpu_type,
            **({"kv_cache_gib": kv["prefill"]} if "prefill" in kv else {}),
        },
        "decode": {
            "replicas": candidate.decode_replicas,
            "tensor_parallel_size": candidate.decode_tp,
            "gpu_type": gpu_type,
            **({"kv_cache_gib": kv["decode"]} if "decode" in kv else {}),
        },
        "transport": {"kind": "auto"},
        "router": {"port": 8000},
        "registry": {"embedded": True},
    }


def write_cluster_file(path: str | Path, document: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(document, sort_keys=False))
