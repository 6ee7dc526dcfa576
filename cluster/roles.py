"""`pdserve roles`: show or set the prefill:decode split of a cluster's flex workers, through
its router (`GET`/`POST /pdserve/roles`); the change holds from the router's next request on."""

import argparse
import os
import sys

import httpx

API_KEY_ENV = "PDSERVE_API_KEY"


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
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = f"{args.url.rstrip('/')}/pdserve/roles"
    asked = {key: getattr(args, key) for key in ("prefill", "decode")}
    try:
        if all(value is None for value in asked.values()):
            response = httpx.get(url, headers=headers, timeout=10)
        else:
            body = {key: value for key, value in asked.items() if value is not None}
            response = httpx.post(url, json=body, headers=headers, timeout=10)
    except httpx.HTTPError as error:
        print(f"pdserve roles: cannot reach {url}: {error}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        message = response.json().get("error", {}).get("message", response.text)
        print(f"pdserve roles: {response.status_code}: {message}", file=sys.stderr)
        return 1
    view = response.json()
    for change in view.get("changes", []):
        print(f"{change['worker']}: {change['from']} -> {change['to']}")
    for worker in view["workers"]:
        kind = "flex" if worker["flex"] else "fixed"
        print(f"{worker['worker']:<40} {worker['role']:<10} {kind}")
    split = view["flex"]
    standby = f", {split['standby']} on standby" if split["standby"] else ""
    print(f"flex workers: {split['prefill']} prefill, {split['decode']} decode{standby}")
    return 0
