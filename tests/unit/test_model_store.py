"""Model folders: made once, verified, and refused when broken."""

import json
import shutil
import time

import pytest

from pdserve.model_store import store as model_store


def test_smollm2_is_a_complete_llama_folder(smollm2_dir):
    model_store.verify(smollm2_dir)
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["eos_token_id"],
    ) == (30, 9, 3, 2)


def test_a_second_fetch_does_no_work(smollm2_dir):
    marker = smollm2_dir / model_store.MARKER
    before = marker.stat().st_mtime_ns
    started = time.monotonic()
    assert model_store.ensure_model("smollm2", log=lambda _: None) == smollm2_dir
    assert time.monotonic() - started < 5
    assert marker.stat().st_mtime_ns == before


def test_tiny_has_head_counts_divisible_by_two():
    config = json.loads(
        (model_store.ensure_model("tiny", log=lambda _: None) / "config.json").read_text()
    )
    assert config["num_attention_heads"] % 2 == 0 and config["num_key_value_heads"] % 2 == 0


def test_a_broken_folder_is_refused(tmp_path, smollm2_dir):
    broken = tmp_path / "broken"
    shutil.copytree(smollm2_dir, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(model_store.ModelError, match="model.safetensors"):
        model_store.verify(broken)


def test_an_unknown_model_name_is_refused():
    with pytest.raises(model_store.ModelError, match="unknown model"):
        model_store.ensure_model("gpt-9")
