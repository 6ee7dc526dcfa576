"""docs/security.md's table of ports names every port the router and a worker can listen on (a
new port flag without a row there, saying what it authenticates, fails here), and every test
its findings table cites exists."""

import re
from pathlib import Path

from pdserve.settings.router import RouterSettings
from pdserve.settings.worker import WorkerSettings

ROOT = Path(__file__).parents[2]
DOC = (ROOT / "docs" / "security.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(f"## {title}")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end > 0 else None]


def test_every_port_flag_has_a_row_in_the_ports_table():
    first_cells = [
        line.split("|")[1] for line in _section("Ports").splitlines() if line.startswith("| ")
    ]
    for model in (RouterSettings, WorkerSettings):
        for name in model.model_fields:
            if name == "port" or name.endswith("_port"):
                flag = "`--" + name.replace("_", "-")
                assert any(flag in cell for cell in first_cells), f"{flag}` has no row"


def test_every_test_the_findings_table_cites_exists():
    cited = re.findall(r"`((?:tests/\w+/)?test_\w+\.py)(?:::(\w+))?", _section("The 2026-12"))
    assert len(cited) > 20
    for path, name in cited:
        found = [f.read_text() for f in (ROOT / "tests").rglob(Path(path).name)]
        assert found and (not name or any(f"def {name}(" in text for text in found)), (path, name)
