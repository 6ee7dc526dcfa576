"""A command whose optional extra is not installed names the extra to install, and `pdserve --help`
still lists every command: each case runs in a fresh interpreter where the extra's package cannot
be imported (a None entry in sys.modules)."""

import subprocess
import sys

import pytest

from pdserve.core.extras import missing_extra

pytestmark = pytest.mark.timeout(120)


def pdserve_without(package: str, *argv: str) -> subprocess.CompletedProcess:
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "from pdserve.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )


def test_up_without_ray_names_the_ray_extra():
    result = pdserve_without("ray", "up", "--help")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        "pdserve up: ray is not installed: it comes with pdserve's ray extra "
        "(pip install 'pdserve[ray]')"
    )


def test_help_without_ray_lists_the_ray_commands_as_unavailable():
    result = pdserve_without("ray", "--help")
    assert result.returncode == 0, result.stderr
    lines = " ".join(result.stdout.split())  # argparse wraps the help text
    assert "up (unavailable: ray is not installed" in lines
    assert "router " in lines and "worker " in lines


def test_a_package_no_extra_installs_is_raised_as_it_is():
    assert missing_extra(ModuleNotFoundError(name="no_such_package")) is None
    assert "pdserve[ops]" in missing_extra(ModuleNotFoundError(name="matplotlib.figure"))
    assert "'pdserve[cpu]' or pip install 'pdserve[gpu]'" in missing_extra(
        ModuleNotFoundError(name="torch")
    )
