"""The `pdserve` command line: one sub-command per module, each registering itself.

Every command module exposes `add_parser(subparsers)`, which adds its sub-command and sets
`run=<function(args) -> int>`. Modules import their heavy dependencies (vLLM, torch) inside
`run`, so `pdserve --help` stays fast. A command whose optional extra is not installed says which
one to install (pdserve/core/extras.py).
"""

import argparse
import importlib
import sys

from pdserve.core.extras import missing_extra
from pdserve.core.grpc_polling import poll_on_callers_thread

COMMAND_MODULES = {  # sub-command -> the module that registers it
    "model": "pdserve.model_store.command",
    "worker": "pdserve.worker.command",
    "serve": "pdserve.cluster.serve",
    "router": "router.command",
    "revoke-key": "router.shared.revoke_command",
    "up": "pdserve.cluster.up",
    "down": "pdserve.cluster.down",
    "status": "pdserve.cluster.status",
    "scale": "pdserve.cluster.scale",
    "roles": "pdserve.cluster.roles",
    "k8s": "pdserve.cluster.k8s.command",
    "bench": "pdserve.bench.command",
    "sweep": "pdserve.bench.sweep_command",
    "plan": "pdserve.planner.command",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every sub-command's parser, or only `command`'s: a worker or a router started by a
    launcher loads no other command's module (the cluster commands load Ray, ~1 s of a core)."""
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMAND_MODULES.items():
        if command in (None, name):
            try:
                importlib.import_module(module).add_parser(subparsers)
            except ModuleNotFoundError as error:  # listed by `pdserve --help`, with what it needs
                if command is not None or missing_extra(error) is None:
                    raise
                subparsers.add_parser(name, help=f"(unavailable: {missing_extra(error)})")
    return parser


def main(argv: list[str] | None = None) -> int:
    poll_on_callers_thread()  # before any command imports grpc; its children inherit it
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMAND_MODULES else None
    try:
        args = build_parser(command).parse_args(argv)
        return args.run(args)
    except ModuleNotFoundError as error:
        message = missing_extra(error)
        if message is None:
            raise
        print(f"pdserve {argv[0] if argv else ''}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
