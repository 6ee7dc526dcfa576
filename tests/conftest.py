"""Fixtures both tiers use: the SmolLM2 model folder (made once by `pdserve model fetch`)."""

from pathlib import Path

import pytest

from pdserve.model_store.store import ensure_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return ensure_model("smollm2")
