"""Client authentication: API keys, as OpenAI's clients send them (`Authorization: Bearer KEY`).

Keys come from `--api-key` (repeatable; visible in the process list, so prefer the others), a
file (`--api-key-file`, one key per line, `#` comments) and the PDSERVE_API_KEYS environment
variable (comma-separated). With none, the router is open. Keys are compared in constant time
and never logged; one revoked with `pdserve revoke-key` is refused by every router of the
cluster within a second (router/shared_state.py). `/health` is always open (probes carry no
key); `/metrics` is open unless `--no-public-metrics`.
"""

import hmac
import os
from pathlib import Path

from pdserve.settings.base import ConfigError
from pdserve.settings.router import RouterSettings
from router.errors import OpenAIError, invalid_api_key
from router.shared_state import key_digest

ENV = "PDSERVE_API_KEYS"
ALWAYS_OPEN = ("/health",)


def load_api_keys(settings: RouterSettings) -> tuple[str, ...]:
    keys = [key.strip() for key in settings.api_key]
    if settings.api_key_file:
        try:
            lines = Path(settings.api_key_file).read_text().splitlines()
        except OSError as error:
            raise ConfigError(f"--api-key-file: cannot read: {error.strerror}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    keys += [key.strip() for key in os.environ.get(ENV, "").split(",")]
    return tuple(key for key in keys if key)


def open_paths(settings: RouterSettings) -> tuple[str, ...]:
    return ALWAYS_OPEN + (("/metrics",) if settings.public_metrics else ())


def is_authorized(
    header: str | None, keys: tuple[str, ...], revoked: frozenset[str] = frozenset()
) -> bool:
    """`revoked`: SHA-256 digests of keys revoked cluster-wide (`pdserve revoke-key`)."""
    scheme, _, key = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not key:
        return False
    given = key.strip().encode()
    # Every key is compared, whatever matches: the time taken says nothing about the keys.
    known = sum(hmac.compare_digest(given, k.encode()) for k in keys) > 0
    return known and key_digest(key.strip()) not in revoked


def unauthorized(header: str | None) -> OpenAIError:
    message = (
        "You didn't provide an API key: send it as 'Authorization: Bearer KEY'."
        if not header
        else "Incorrect API key provided."
    )
    return invalid_api_key(message)
