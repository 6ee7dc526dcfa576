"""`pdserve revoke-key`: revoke an API key at every router of a cluster at once.

The key is read from standard input (never from the command line, which the process list
shows); its SHA-256 digest goes into the cluster's Redis (router/shared/state.py), and every
router refuses the key (401) within a second, whatever its --api-key or --api-key-file says.
"""

import argparse
import asyncio
import sys

from pdserve.settings.redis_url import masked
from router.shared.state import SharedState


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "revoke-key",
        help="revoke an API key (read from stdin) at every router of a cluster",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--registry",
        required=True,
        metavar="REDIS_URL",
        help="the cluster's Redis (the routers' --registry); a password from "
        "PDSERVE_REDIS_PASSWORD",
    )
    parser.add_argument(
        "--cluster", default="pdserve", help="the cluster's name in the registry (default: pdserve)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("pdserve revoke-key: give the key on standard input", file=sys.stderr)
        return 2
    try:
        new = asyncio.run(_revoke(args.registry, args.cluster, key))
    except Exception as error:  # Redis away, refused, wrong password
        print(f"pdserve revoke-key: {masked(args.registry)}: {error}", file=sys.stderr)
        return 1
    print("revoked" if new else "already revoked", file=sys.stderr)
    return 0


async def _revoke(url: str, cluster: str, key: str) -> bool:
    shared = SharedState(url, cluster, me="revoke-key")
    try:
        return await shared.revoke_key(key)
    finally:
        await shared.close()
