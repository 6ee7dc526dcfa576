"""The compatibility handshake compares the KV cache, not the model (kv_transfer/compatibility.py):
an fp8-KV prefill worker and a bf16-KV decode worker of the same bf16 model are refused at
pairing (the router's real WorkerChoice.pick over fake workers) and at the hello; workers
alike in everything pair. The engine's side is read from vLLM's real CacheConfig with a fake
model config (the four answers compatibility_of asks of it), and from vLLM's real engine
config for SmolLM2 (EngineArgs, no engine started). No network."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from kv_transfer.compatibility import (
    REFUSAL_PREFIX,
    Compatibility,
    check_hello,
    compatibility_of,
)
from kv_transfer.grpc_transport import hello
from pdserve.core.kinds import Role
from pdserve.settings.cluster_secret import SECRET_ENV
from router.http.errors import OpenAIError
from router.workers.choice import WorkerChoice
from router.workers.policies import RoundRobin
from router.workers.pool import WorkerPool
from tests.fakes import FakeWorker


@dataclass
class FakeModelConfig:
    """Stands in for vLLM's ModelConfig: a bf16 Llama-like model, 8 KV heads of 128."""

    model: str = "/models/llama-8b"
    dtype: torch.dtype = torch.bfloat16
    use_mla: bool = False

    def get_head_size(self) -> int:
        return 128

    def get_num_layers(self, parallel) -> int:
        return 32

    def get_total_num_kv_heads(self) -> int:
        return 8


def engine(
    cache_dtype: str = "auto", block_size: int = 16, integrity: bool = True, **model
) -> Compatibility:
    """compatibility_of an engine with vLLM's real CacheConfig and KVTransferConfig and a fake
    model config (vLLM imported here, not at collection: it takes ~10 s, which every test
    process paid)."""
    from vllm.config import CacheConfig, KVTransferConfig

    return compatibility_of(
        SimpleNamespace(
            model_config=FakeModelConfig(**model),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
            quant_config=None,
            kv_transfer_config=KVTransferConfig(
                kv_connector="DecodeConnector",
                kv_role="kv_consumer",
                kv_connector_extra_config={"integrity": integrity},
            ),
        )
    )


def test_a_real_engine_config_states_its_kv_cache_not_its_models_dtype(smollm2_dir):
    from vllm.engine.arg_utils import EngineArgs

    def of(kv_cache_dtype: str) -> Compatibility:
        args = EngineArgs(
            model=str(smollm2_dir),
            dtype="float32",
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=True,
        )
        return compatibility_of(args.create_engine_config())

    auto, fp8 = of("auto"), of("fp8")
    assert (auto.dtype, auto.bytes_per_head_token, auto.kv_scale_mode) == ("float32", 512, "none")
    assert (fp8.dtype, fp8.bytes_per_head_token, fp8.kv_scale_mode) == (
        "fp8_e4m3",
        128,
        "fp8_per_tensor",
    )
    assert (auto.total_kv_heads, auto.head_size, auto.block_size) == (3, 64, 128)


def test_the_kv_cache_dtype_is_compared_not_the_models():
    bf16, fp8 = engine("auto"), engine("fp8")
    assert (bf16.dtype, bf16.bytes_per_head_token, bf16.kv_scale_mode) == ("bfloat16", 512, "none")
    assert (fp8.dtype, fp8.bytes_per_head_token, fp8.kv_scale_mode) == (
        "fp8_e4m3",
        256,
        "fp8_per_tensor",
    )
    assert engine("fp8_e4m3") == fp8  # vLLM: fp8 is fp8_e4m3, the same bytes
    assert engine("fp8_e5m2").dtype == "fp8_e5m2" != fp8.dtype
    assert engine("bfloat16") == bf16  # "auto" is the model's dtype
    assert engine("auto", dtype=torch.float16).dtype == "float16"


@pytest.mark.parametrize(
    "other",
    [
        {"cache_dtype": "fp8"},
        {"cache_dtype": "fp8_e5m2"},
        {"block_size": 32},
        {"use_mla": True},
        {"dtype": torch.float16},
        {"integrity": False},
    ],
)
def test_the_fingerprint_changes_with_what_the_kv_bytes_mean(other):
    assert engine(**other).fingerprint() != engine().fingerprint()


def worker(name: str, role: str, kv_compatibility: str) -> FakeWorker:
    fake = FakeWorker(name, role)
    fake.identity.kv_compatibility = kv_compatibility
    return fake


def choice_of(*workers: FakeWorker) -> WorkerChoice:
    pool = WorkerPool([])
    pool.workers = list(workers)
    return WorkerChoice(pool, RoundRobin())


def test_an_fp8_kv_prefill_is_refused_for_a_bf16_kv_decode_at_pairing_naming_both():
    prefill = worker("prefill-fp8", Role.PREFILL, engine("fp8").fingerprint())
    decode = worker("decode-bf16", Role.DECODE, engine("auto").fingerprint())
    with pytest.raises(OpenAIError) as refused:
        choice_of(prefill, decode).pick((Role.PREFILL,), pairs_with=decode)
    message = refused.value.message
    assert "decode-bf16's (llama-8b KV bfloat16 (none scales, 512 B per head-token)" in message
    assert "prefill-fp8 has llama-8b KV fp8_e4m3 (fp8_per_tensor scales, 256 B" in message


def test_workers_alike_in_everything_pair():
    decode = worker("decode-a", Role.DECODE, engine("fp8").fingerprint())
    alike = worker("prefill-a", Role.PREFILL, engine("fp8_e4m3").fingerprint())
    other = worker("prefill-b", Role.PREFILL, engine("auto").fingerprint())
    choice = choice_of(other, alike, decode)
    assert {
        choice.pick((Role.PREFILL,), pairs_with=decode).identity.worker_id for _ in range(4)
    } == {"prefill-a"}


def test_the_hello_of_an_fp8_kv_producer_is_refused_by_a_bf16_kv_consumer(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    refusal = check_hello(hello(engine("fp8")), engine("auto"), "s3cret")
    assert refusal.startswith(REFUSAL_PREFIX)
    assert "dtype: producer 'fp8_e4m3' != consumer 'bfloat16'" in refusal
    assert "bytes_per_head_token: producer 256 != consumer 512" in refusal
    assert "kv_scale_mode: producer 'fp8_per_tensor' != consumer 'none'" in refusal
    assert check_hello(hello(engine("fp8")), engine("fp8_e4m3"), "s3cret") == ""


def test_a_sender_without_integrity_is_refused_by_a_receiver_that_checks(monkeypatch):
    """Else the receiver would refuse each of its slices (no digest), or, the other way round,
    load a checking sender's KV unchecked."""
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    assert "integrity off" in engine(integrity=False).fingerprint()
    refusal = check_hello(hello(engine(integrity=False)), engine(), "s3cret")
    assert "integrity: producer False != consumer True" in refusal
    refusal = check_hello(hello(engine()), engine(integrity=False), "s3cret")
    assert "integrity: producer True != consumer False" in refusal


def test_a_pooled_workers_fingerprint_states_its_own_connectors_integrity():
    """A worker in a KV pool runs vLLM's MultiConnector: its fingerprint reads pdserve's
    connector's integrity setting inside it (read at the top, every pooled worker said `on`,
    and a prefill worker without integrity refused its decode worker without it)."""
    from vllm.config import KVTransferConfig

    from kv_transfer.compatibility import integrity_of
    from pdserve.settings.worker import WorkerSettings
    from pdserve.worker.engine import kv_transfer_config

    for integrity in ("on", "off"):
        for role in ("prefill", "decode"):
            settings = WorkerSettings(role=role, kv_pool_address="@pool", kv_integrity=integrity)
            config = KVTransferConfig(**kv_transfer_config(settings, 7000))
            assert config.kv_connector == "MultiConnector"
            vllm_config = SimpleNamespace(kv_transfer_config=config)
            assert integrity_of(vllm_config) == (integrity == "on"), (role, integrity)
