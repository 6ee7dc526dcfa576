"""No sub-command reads a settings flag from its argparse namespace.

A settings flag (pdserve/settings/command_line.py) is left out of the namespace when it is not
given (`default=argparse.SUPPRESS`, so the settings model's default applies): code that reads
`args.port` works in every test that passes `--port` and crashes for the user who does not
(seen: `./scripts/serve.sh`, the README's first command). The code reads the settings object
that `from_arguments` built instead. Checked over the source: each sub-command's module, and
every module it hands its namespace to, for `args.<flag>` and `getattr(args, "<flag>")` reads of
a flag that may be left out.
"""

import argparse
import ast
import importlib.util
from pathlib import Path

import pytest

from pdserve.cli import COMMAND_MODULES, build_parser

ROOT = Path(__file__).parents[2]


def _left_out_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The dests of `parser` (and its sub-parsers) that are absent from the namespace when
    their flag is not given."""
    dests = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                dests |= _left_out_flags(sub)
        elif action.default is argparse.SUPPRESS and action.dest != argparse.SUPPRESS:
            dests.add(action.dest)
    return dests - {"help"}


def _source(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # "pathlib.Path": not a module
        return None
    origin = Path(spec.origin) if spec and spec.origin else None
    return origin if origin and ROOT in origin.parents else None


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> the project module it names (or the module a function comes from)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names[alias.asname or alias.name] = full if _source(full) else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    return names


def _namespace_reads(module: str, seen: set[str]) -> list[tuple[str, int, str]]:
    """(file, line, name) of every read of `args.name` in `module` and in the project modules
    it passes `args` to, followed."""
    path = _source(module)
    if path is None or module in seen:
        return []
    seen.add(module)
    tree = ast.parse(path.read_text())
    imports = _imports(tree)
    reads = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "args"
            and isinstance(node.ctx, ast.Load)
        ):
            reads.append((str(path.relative_to(ROOT)), node.lineno, node.attr))
        elif isinstance(node, ast.Call):
            passes_args = any(isinstance(a, ast.Name) and a.id == "args" for a in node.args)
            if (
                isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and passes_args
                and len(node.args) == 2  # getattr(args, "x", default) is safe
                and isinstance(node.args[1], ast.Constant)
            ):
                reads.append((str(path.relative_to(ROOT)), node.lineno, node.args[1].value))
            elif passes_args:
                callee = node.func
                while isinstance(callee, ast.Attribute):
                    callee = callee.value
                if isinstance(callee, ast.Name) and callee.id in imports:
                    reads += _namespace_reads(imports[callee.id].rpartition(".")[0], seen)
                    reads += _namespace_reads(imports[callee.id], seen)
    return reads


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_no_command_reads_a_flag_that_may_be_left_out(command):
    parser = build_parser(command)
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    left_out = _left_out_flags(subparsers.choices[command])
    reads = _namespace_reads(COMMAND_MODULES[command], set())
    bad = [f"{path}:{line}: args.{name}" for path, line, name in reads if name in left_out]
    assert not bad, f"read the settings object instead: {bad}"


def test_the_check_finds_the_read_that_crashed_serve(tmp_path, monkeypatch):
    """The check itself: the line that crashed `./scripts/serve.sh` is found."""
    module = tmp_path / "crashing_serve.py"
    module.write_text("def run(args):\n    return args.port == 0\n")
    monkeypatch.setattr("tests.unit.test_cli_left_out_flags.ROOT", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert _namespace_reads("crashing_serve", set()) == [("crashing_serve.py", 2, "port")]


def test_every_command_parses_with_no_flags_at_all():
    """What a user types first: the sub-command alone (those needing an argument excepted)."""
    for command in COMMAND_MODULES:
        try:
            args = build_parser(command).parse_args([command])
        except SystemExit:
            continue  # a required argument: argparse said which
        assert callable(args.run)
