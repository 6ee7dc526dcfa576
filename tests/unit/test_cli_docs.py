"""Every command-line option is documented in the README."""

import argparse
from pathlib import Path

from pdserve.cluster.cli import build_parser

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def options(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{path} {name}")
        else:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help":
                    yield path, flag


def test_every_option_is_in_the_readme():
    missing = [
        f"{path} {flag}"
        for path, flag in options(build_parser(), "pdserve")
        if f"`{flag}`" not in README
    ]
    assert not missing, f"options missing from README.md: {missing}"
