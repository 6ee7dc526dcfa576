"""The cluster secret: one shared value that every worker gRPC call and every KV stream must
carry, so a process that can reach a worker's ports but is not part of the cluster can neither
call the worker nor push KV into its cache.

It lives in the environment variable PDSERVE_CLUSTER_SECRET, which a worker's vLLM engine
processes (where the KV senders and receivers run) inherit; `--cluster-secret-file` puts a
file's content there at start. `pdserve serve` and `pdserve up` generate one when none is set.
With none set at all the cluster is open (a worker started by hand, as before). The secret is
compared in constant time and never logged.

It also signs what the cluster keeps in Redis (`signature`): the workers' registry records
(pdserve/protocol/registry.py) and the routers' shared state (router/shared/state.py), so a
process that can write to Redis but lacks the secret cannot forge them.
"""

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from pdserve.settings.config_error import ConfigError

SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
METADATA_KEY = "x-pdserve-cluster-secret"  # gRPC metadata of every worker call


def cluster_secret() -> str:
    """This process's cluster secret ('' when the cluster is open)."""
    return os.environ.get(SECRET_ENV, "")


def load_cluster_secret(path: str) -> None:
    """Put the secret in `path` (if given) into this process's environment, where the engine
    processes it starts will find it; ConfigError when the file cannot be read or is empty."""
    if not path:
        return
    try:
        value = Path(path).read_text().strip()
    except OSError as error:
        raise ConfigError(f"cannot read the cluster secret file {path}: {error}") from None
    if not value:
        raise ConfigError(f"the cluster secret file {path} is empty")
    os.environ[SECRET_ENV] = value


def ensure_cluster_secret() -> None:
    """Generate a secret for this process and its children unless one is set."""
    os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))


def secret_matches(offered: str, expected: str) -> bool:
    """Whether `offered` is the `expected` secret (anything is, when the cluster is open)."""
    return not expected or hmac.compare_digest(offered.encode(), expected.encode())


def secret_metadata() -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the secret on a call to a worker."""
    secret = cluster_secret()
    return ((METADATA_KEY, secret),) if secret else ()


def signature(message: str | bytes) -> str:
    """`message`'s HMAC-SHA256 under the cluster secret, in hex ('' when the cluster is open)."""
    secret = cluster_secret()
    if not secret:
        return ""
    data = message.encode() if isinstance(message, str) else message
    return hmac.new(secret.encode(), data, hashlib.sha256).hexdigest()


def signature_valid(message: str | bytes, mac: object) -> bool:
    """Whether `mac` is `message`'s signature (anything is when the cluster is open). Never
    raises: a `mac` that is not an ASCII string (read from Redis, so anything) is simply not
    valid."""
    if not cluster_secret():
        return True
    if not isinstance(mac, str) or not mac.isascii():
        return False
    return hmac.compare_digest(mac, signature(message))
