"""`pdserve roles`: show or set the prefill:decode split of a cluster's flex workers, through
its router (`GET`/`POST /pdserve/roles`); the change holds from the router's next request on."""

import argparse
import os
import sys

from pdserve.protocol.router_admin import API_KEY_ENV, ask_roles
from pdserve.settings.base import ConfigError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "roles",
        help="show or set the flex workers' prefill:decode split",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the router (default: http://127.0.0.1:8000)",
    )
    parser.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers")
    parser.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers")
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV, ""),
        metavar="KEY",
        help=f"the router's API key, if it has keys (default: ${API_KEY_ENV})",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    asked = {key: getattr(args, key) for key in ("prefill", "decode")}
    split = {key: value for key, value in asked.items() if value is not None} or None
    try:
        view = ask_roles(args.url, split, args.api_key)
    except ConfigError as error:
        print(f"pdserve roles: refused: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"pdserve roles: {error}", file=sys.stderr)
        return 1
    for change in view.get("changes", []):
        print(f"{change['worker']}: {change['from']} -> {change['to']}")
    for worker in view["workers"]:
        kind = "flex" if worker["flex"] else "fixed"
        print(f"{worker['worker']:<40} {worker['role']:<10} {kind}")
    split = view["flex"]
    standby = f", {split['standby']} on standby" if split["standby"] else ""
    print(f"flex workers: {split['prefill']} prefill, {split['decode']} decode{standby}")
    return 0
