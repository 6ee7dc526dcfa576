"""Byte-exact transfers from and into every cache layout vLLM 0.32 allocates (its six
KVCacheLayouts) and the four older ones the code still reads, in bfloat16, float16 and fp8; an
MLA latent ([blocks, 1, block_size, 576], fp8 as 576 uint8 a token) in vLLM 0.32's."""

import pytest

from tests.gpu.kv_caches import DTYPES, LAYOUTS, MLA
from tests.gpu.transfer import assert_exact, transfer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("source", LAYOUTS)
def test_a_transfer_into_another_layout_is_byte_exact(device, source, dtype_name, record_property):
    target = LAYOUTS[(LAYOUTS.index(source) + 1) % len(LAYOUTS)]
    (outcome,) = transfer(device, DTYPES[dtype_name], source, target)
    record_property("detail", f"into {target}: " + assert_exact(outcome))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_an_mla_latent_into_another_layout_is_byte_exact(device, dtype_name, record_property):
    """A layer-compact source, a layer-interleaved target (vLLM's six orders differ only in where
    the layer and block dimensions go when there is one head)."""
    (outcome,) = transfer(device, DTYPES[dtype_name], "LBHNC", "BLNHC", geometry=MLA)
    record_property("detail", assert_exact(outcome))
