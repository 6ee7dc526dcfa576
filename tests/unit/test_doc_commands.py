"""Every command the docs show parses: its sub-command and every flag it names exist, with
values of the right kind (a doc naming a flag that no longer exists fails here).

The commands are the lines of README.md's and docs/*.md's shell code blocks that start with
`pdserve`, `./scripts/` or `python scripts/`. `pdserve ...` and `./scripts/serve.sh ...` (its
arguments go to `pdserve serve`) are parsed by pdserve's own parser; a script's own parser runs
in one child process, stopped right after it has parsed its arguments.
"""

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser

ROOT = Path(__file__).parents[2]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
PYTHONS = ("python", "python3", ".venv/bin/python")


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of each command in the docs' shell blocks."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in SHELL_BLOCK.findall(page.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                words = shlex.split(line.strip().removeprefix("$ "), comments=True)
                if words and (
                    words[0] in ("pdserve", *PYTHONS) or words[0].startswith("./scripts/")
                ):
                    if words[0] in PYTHONS and not words[1:2][0].startswith("scripts/"):
                        continue
                    found.append((f"{page.relative_to(ROOT)}: {line.strip()[:80]}", words))
    return found


def _is_documented_command(words: list[str]) -> bool:
    if not words:
        return False
    if words[0] in PYTHONS:
        return len(words) > 1 and words[1].startswith("scripts/")
    return words[0] == "pdserve" or words[0].startswith("./scripts/")


COMMANDS = doc_commands()


def _pdserve_argv(words: list[str]) -> list[str] | None:
    """The `pdserve` arguments a command stands for, None for a script with its own parser."""
    if words[0] == "pdserve":
        return words[1:]
    if words[0] == "./scripts/serve.sh":
        return ["serve", *words[1:]]
    return None


def _pdserve_parses(argv: list[str]) -> str:
    """argparse's complaint, or "" when `pdserve argv` parses."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            build_parser(argv[0] if argv else None).parse_args(argv)
    except SystemExit as stop:
        return errors.getvalue() or f"exit {stop.code}"
    return ""


def test_the_docs_show_commands_of_every_kind():
    kinds = {words[0] for _, words in COMMANDS}
    assert {"pdserve", "./scripts/serve.sh", "python"} <= kinds


@pytest.mark.parametrize(
    "where,words",
    [(w, c) for w, c in COMMANDS if _pdserve_argv(c) is not None],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_a_pdserve_command_in_the_docs_parses(where, words):
    assert _pdserve_parses(_pdserve_argv(words)) == ""


def test_a_flag_that_no_longer_exists_fails_the_check():
    assert "--no-such-flag" in _pdserve_parses(["serve", "--no-such-flag", "1"])


# Runs each script given (argv lists, JSON on stdin) until its parser has parsed its arguments;
# prints {index: argparse's complaint, or ""}.
SCRIPT_PARSER_RUNNER = """
import argparse, contextlib, io, json, runpy, sys

class Parsed(Exception):
    pass

def stop_after(parse):
    def parsed(self, *args, **kwargs):
        parse(self, *args, **kwargs)
        raise Parsed
    return parsed

argparse.ArgumentParser.parse_args = stop_after(argparse.ArgumentParser.parse_args)
results = {}
for index, argv in enumerate(json.load(sys.stdin)):
    sys.argv, errors = argv, io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(argv[0], run_name="__main__")
        results[index] = "the script never parsed its arguments"
    except Parsed:
        results[index] = ""
    except SystemExit as stop:
        results[index] = errors.getvalue() or f"exit {stop.code}"
print(json.dumps(results))
"""


def _scripts_parse(commands: list[list[str]]) -> list[str]:
    """argparse's complaint about each script command (argv), or ""."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT_PARSER_RUNNER],
        input=json.dumps(commands),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.splitlines()[-1])
    return [results[str(i)] for i in range(len(commands))]


def test_every_script_command_in_the_docs_parses():
    scripts = [
        (where, words[1:] if words[0] in PYTHONS else words)
        for where, words in COMMANDS
        if _pdserve_argv(words) is None and words[0] != "./scripts/test.sh"  # pytest's arguments
    ]
    assert scripts
    complaints = _scripts_parse([argv for _, argv in scripts])
    failed = {where: error for (where, _), error in zip(scripts, complaints, strict=True) if error}
    assert not failed, failed
    assert (
        "unrecognized arguments: --no-such-flag"
        in _scripts_parse([["scripts/bench_router.py", "--no-such-flag"]])[0]
    )
