"""The cluster file `pdserve plan --write-cluster` writes: the recommended pools in the YAML
layout cluster/config.py loads, so a plan can be brought up as it was simulated."""

from pathlib import Path

import yaml

from planner.search import Candidate


def cluster_document(candidate: Candidate, model: str, dtype: str, gpu_type: str) -> dict:
    """`dtype` "auto" means the model's own, as in vLLM."""
    return {
        "model": {"name": model, "dtype": dtype},
        "engine": {},
        "prefill": {"replicas": candidate.prefill_replicas,
                    "tensor_parallel_size": candidate.prefill_tp, "gpu_type": gpu_type},
        "decode": {"replicas": candidate.decode_replicas,
                   "tensor_parallel_size": candidate.decode_tp, "gpu_type": gpu_type},
        "transport": {"kind": "grpc"},
        "router": {"port": 8000},
        "registry": {"embedded": True},
    }


def write_cluster_file(path: str | Path, document: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(document, sort_keys=False))
