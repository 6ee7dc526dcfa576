"""`--dtype auto`: the model's own on a GPU; on a CPU bfloat16 only with bfloat16 dot products."""

import pytest
import torch

from pdserve.settings.engine import EngineSettings
from pdserve.worker.engine_dtype import engine_dtype


def test_the_default_is_auto():
    assert EngineSettings().dtype == "auto"


@pytest.mark.parametrize("avx512_bf16, amx, expected", [
    (True, False, "bfloat16"),
    (False, True, "bfloat16"),
    (False, False, "float32"),
])  # fmt: skip
def test_auto_on_a_cpu_follows_its_instructions(monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert engine_dtype("auto", cpu=True) == expected


def test_a_torch_without_the_checks_means_float32(monkeypatch):
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert engine_dtype("auto", cpu=True) == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_kept_on_any_device(dtype):
    assert engine_dtype(dtype, cpu=True) == engine_dtype(dtype, cpu=False) == dtype


def test_auto_on_a_gpu_is_vllms_own():
    assert engine_dtype("auto", cpu=False) == "auto"
