"""Byte-exact transfers from and into every cache layout vLLM 0.32 allocates (its six
KVCacheLayouts) and the four older ones the code still reads, in bfloat16, float16 and fp8."""

import pytest

from tests.gpu.kv_caches import DTYPES, LAYOUTS
from tests.gpu.transfer import assert_exact, transfer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("source", LAYOUTS)
def test_a_transfer_into_another_layout_is_byte_exact(device, source, dtype_name, record_property):
    target = LAYOUTS[(LAYOUTS.index(source) + 1) % len(LAYOUTS)]
    (outcome,) = transfer(device, DTYPES[dtype_name], source, target)
    record_property("detail", f"into {target}: " + assert_exact(outcome))
