"""Engine settings: what builds a worker's vLLM engine. The values that must match between a
prefill and a decode worker (model, dtype, context length) come from here, for every launcher."""

from typing import Annotated

from pydantic import Field

from pdserve.settings.base import Settings

Model = Annotated[
    str,
    Field(
        default="smollm2",
        description="a model name made by `pdserve model` (smollm2, tiny), a Hugging Face folder, "
        "or a Hugging Face id (where a hub is reachable)",
    ),
]
Dtype = Annotated[
    str,
    Field(
        default="float32", description="weights and activations dtype (float32 is fastest on CPU)"
    ),
]
MaxModelLen = Annotated[
    int | None,
    Field(default=None, ge=1, description="context length in tokens (default: the model's own)"),
]
KvCacheGib = Annotated[
    float,
    Field(
        default=2.0,
        gt=0,
        description="KV cache per GPU (per tensor-parallel rank) in GiB: vLLM reserves it on "
        "each rank, so a worker at TP N holds N times this",
    ),
]
Seed = Annotated[int, Field(default=0, description="engine random seed")]
TensorParallelSize = Annotated[
    int, Field(default=1, ge=1, description="GPUs (or CPU ranks) per worker")
]
EnforceEager = Annotated[
    bool | None,
    Field(
        default=None,
        description="run the model eagerly, without CUDA graphs or torch.compile (default: yes "
        "on CPU, where compiling took 139 s for no gain; no on GPU, so decode runs with CUDA "
        "graphs)",
    ),
]
Quantization = Annotated[
    str | None,
    Field(default=None, description="vLLM quantization method, e.g. fp8 (default: none)"),
]


class EngineSettings(Settings):
    model: Model
    dtype: Dtype
    max_model_len: MaxModelLen
    kv_cache_gib: KvCacheGib
    seed: Seed
    tensor_parallel_size: TensorParallelSize
    quantization: Quantization
    enforce_eager: EnforceEager
