"""Every KV fault kind (tests/kv_faults.py) injected in the real sender's channels: the decode ranks
refuse the damaged transfer as the damage it is (a delayed one loads), after a clean one on the same
channels; per-head K/V caches and an MLA latent (sent by one prefill rank of two)."""

import pytest

from tests.gpu.kv_caches import GQA, MLA
from tests.gpu.transfer import assert_exact, transfer

pytestmark = pytest.mark.gpu

FAULT_DAMAGE = {  # fault kind -> what the decode worker must find (None: loads fine)
    "corrupt": "digest",
    "truncate": "length",
    "duplicate": "duplicate",
    "reorder": "order",
    "stale": "stale",
    "delay": None,
}


CACHES = {"per-head K/V": (GQA, 1), "MLA latent, TP 2 to 1": (MLA, 2)}  # (geometry, prefill TP)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("kind", FAULT_DAMAGE)
def test_a_damaged_transfer_is_refused_as_its_damage(device, kind, cache, record_property):
    # A stale slice is one kept from the transfer before (its sender marked for the fault too).
    first = f"{kind}:1" if kind == "stale" else ""
    geometry, prefill_tp = CACHES[cache]
    clean, faulty = transfer(
        device, geometry=geometry, prefill_tp=prefill_tp, faults=(first, f"{kind}:1")
    )
    assert_exact(clean)
    want = FAULT_DAMAGE[kind]
    if want is None:
        record_property("detail", assert_exact(faulty))
        return
    assert not faulty.loaded and want in faulty.damage, f"expected {want}, got {faulty}"
    record_property("detail", f"refused as {want} on every rank, nothing loaded")
