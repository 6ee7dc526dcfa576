"""Connecting to the cluster's Redis (the registry and the routers' shared state), with its
password kept out of process lists and logs.

A password may be in the URL (`redis://:PASSWORD@host:port/db`, which puts it in a process's
arguments when passed on a command line) or, better, in the PDSERVE_REDIS_PASSWORD environment
variable, which the children of `pdserve serve` and `up` inherit. Every URL pdserve logs goes
through `masked` first.
"""

import os
from urllib.parse import urlsplit, urlunsplit

PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
TIMEOUT_S = 5.0  # connect and per-command: a Redis that does not answer is an error, not a hang


def connect(url: str):
    """An asyncio Redis client for `url`; the password from PDSERVE_REDIS_PASSWORD unless the
    URL has one."""
    import redis.asyncio as redis

    password = None if urlsplit(url).password else os.environ.get(PASSWORD_ENV) or None
    return redis.Redis.from_url(
        url, password=password, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
    )


def masked(url: str) -> str:
    """`url` with its password (if any) replaced by ***."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))
