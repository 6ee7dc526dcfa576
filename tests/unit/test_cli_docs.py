"""The docs site's CLI reference holds every flag of every command, its metrics page every
metric and label, and the README stays short.

The reference is what docs/hooks/cli_reference.py renders at build time; this calls the same
render function, and walks the parsers on its own to know what must be there.
"""

import argparse
import importlib.util
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.cli import build_parser
from pdserve.core.kinds import RoutePath, RouteReason
from pdserve.worker.metrics_server import WorkerMetrics
from router.http.errors import ErrorKind
from router.metrics import RouterMetrics
from router.workers.flex_roles import RoleMetrics

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 150


def load_hook():
    path = ROOT / "docs" / "hooks" / "cli_reference.py"
    spec = importlib.util.spec_from_file_location("cli_reference", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def flags(parser: argparse.ArgumentParser, path: str):
    """(command, flag) for every option of every command, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from flags(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            for flag in action.option_strings:
                yield path, flag


def sections(markdown: str) -> dict[str, str]:
    """The reference split by command heading (## `pdserve serve`): command -> its section."""
    parts = re.split(r"^## `([^`]+)`$", markdown, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_every_flag_of_every_command_is_in_the_reference():
    reference = sections(load_hook().render())
    missing = [
        f"{command} {flag}"
        for command, flag in flags(build_parser(), "pdserve")
        if not re.search(f"`{flag}[ `]", reference.get(command, ""))
    ]
    assert not missing, f"flags missing from the CLI reference: {missing}"


def test_every_command_has_a_section():
    reference = sections(load_hook().render())
    assert {"pdserve serve", "pdserve model fetch", "pdserve k8s render"} <= set(reference)
    assert all(command.startswith("pdserve ") for command in reference)


def test_the_reference_page_and_the_hook_are_wired_into_the_site():
    hook = load_hook()
    assert hook.MARKER in (ROOT / "docs" / "cli.md").read_text()
    assert "docs/hooks/cli_reference.py" in (ROOT / "mkdocs.yml").read_text()


def exported(registry: CollectorRegistry):
    """(name as Prometheus exports it, label names) of every metric in `registry`."""
    for collector in registry._collector_to_names:
        suffix = "_total" if collector._type == "counter" else ""
        yield collector._name + suffix, collector._labelnames


def metric_rows() -> dict[str, str]:
    """Metric name -> its row in docs/metrics.md (a row may name several metrics)."""
    return {
        name: row
        for row in (ROOT / "docs" / "metrics.md").read_text().splitlines()
        if row.startswith("| `pdserve_")
        for name in re.findall(r"`(pdserve_\w+)`", row.split("|")[1])
    }


def test_every_metric_and_label_is_on_the_metrics_page():
    registries = [RouterMetrics().registry, CollectorRegistry(), CollectorRegistry()]
    RoleMetrics(registries[1])
    WorkerMetrics(registries[2])
    rows = metric_rows()
    missing = [
        f"{name}{{{','.join(labels)}}}"
        for registry in registries
        for name, labels in exported(registry)
        if name not in rows or not all(f"`{label}`" in rows[name] for label in labels)
    ]
    assert not missing, f"metrics or labels missing from docs/metrics.md: {missing}"


def test_every_value_of_the_enum_labels_is_on_the_metrics_page():
    rows = metric_rows()
    labels = {
        "pdserve_errors_total": ErrorKind,
        "pdserve_route_total": RoutePath,
        "pdserve_route_decisions_total": RouteReason,
    }
    missing = [
        f"{name}: {value}"
        for name, values in labels.items()
        for value in values
        if f"`{value}`" not in rows[name]
    ]
    assert not missing, f"label values missing from docs/metrics.md: {missing}"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
