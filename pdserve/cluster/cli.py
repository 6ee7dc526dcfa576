"""The `pdserve` command line: one sub-command per module, each registering itself.

Every command module exposes `add_parser(subparsers)`, which adds its sub-command and sets
`run=<function(args) -> int>`. Modules import their heavy dependencies (vLLM, torch) inside
`run`, so `pdserve --help` stays fast.
"""

import argparse
import importlib
import sys

COMMAND_MODULES = (
    "pdserve.model_store.command",
    "pdserve.worker.command",
    "pdserve.cluster.serve",
    "router.command",
    "pdserve.cluster.up",
    "pdserve.cluster.down",
    "pdserve.cluster.status",
    "pdserve.cluster.scale",
    "pdserve.cluster.roles",
    "pdserve.cluster.k8s_command",
    "pdserve.bench.command",
    "pdserve.bench.sweep_command",
    "pdserve.planner.command",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
