"""A maintained security and best-practice scan of the manifests: checkov's Kubernetes checks
over every committed overlay (what `pdserve k8s render` makes of deploy/clusters, built by
kustomize), with deploy/k8s/checkov.yaml's skips, each justified there in a comment. checkov
runs from its own venv (scripts/setup.sh: .cache/checkov). Custom resources (RayJob,
LeaderWorkerSet) are beyond checkov's Kubernetes checks: their pods are checked by
test_k8s_render_options.py's Pod Security test instead."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.unit.k8s_rendering import OVERLAYS

ROOT = Path(__file__).resolve().parents[2]
CHECKOV = ROOT / ".cache/checkov/bin/checkov"
CONFIG = ROOT / "deploy/k8s/checkov.yaml"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """Every overlay folder (pdserve.yaml and the folders beside it), built, one file each with
    the documents no folder before it had: most overlays share most of their resources (355
    documents, 84 distinct), and checkov checks each resource on its own."""
    out = tmp_path_factory.mktemp("built")
    folders = [path.parent for path in OVERLAYS.rglob("kustomization.yaml")]
    seen: set[str] = set()
    for folder in folders:
        done = subprocess.run(
            ["kubectl", "kustomize", str(folder)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        new = [doc for doc in done.stdout.split("\n---\n") if doc not in seen]
        seen.update(new)
        if new:
            name = str(folder.relative_to(OVERLAYS)).replace("/", "-")
            (out / f"{name}.yaml").write_text("\n---\n".join(new))
    assert len(folders) >= 16  # 4 cluster files x 2 modes x (pdserve.yaml + its folders)
    return out


def test_checkov_finds_nothing_but_what_is_skipped_and_justified(built):
    assert CHECKOV.exists(), "scripts/setup.sh installs checkov in .cache/checkov"
    done = subprocess.run(
        [str(CHECKOV), "--config-file", str(CONFIG), "-d", str(built), "-o", "json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", "BC_SKIP_MAPPING": "TRUE", "HOME": str(built)},
    )
    reports = json.loads(done.stdout)
    (report,) = reports if isinstance(reports, list) else [reports]
    failed = [
        f"{check['check_id']} {check['check_name']}: {check['resource']}"
        for check in report["results"]["failed_checks"]
    ]
    assert failed == [], "\n".join(failed)
    assert report["summary"]["passed"] > 1000 and report["summary"]["resource_count"] > 50
    skipped = {check["check_id"] for check in report["results"]["skipped_checks"]}
    assert skipped == {"CKV_K8S_38"}  # the endpoint picker's API token, by its annotation


def test_every_skipped_check_says_why():
    text = CONFIG.read_text()
    skips = yaml.safe_load(text)["skip-check"]
    for check in skips:
        reason = re.search(rf"((?:^  # .*\n)+)  - {check}\n", text, re.M)
        assert reason and len(reason.group(1)) > 40, f"{check} is skipped without a reason"
