"""Client authentication: API keys, as OpenAI's clients send them (`Authorization: Bearer KEY`),
and what each key may do.

Keys come from `--api-key` (repeatable; visible in the process list, so prefer the others), a
file (`--api-key-file`, one key per line, `#` comments) and the PDSERVE_API_KEYS environment
variable (comma-separated). Two more lists name the keys trusted further (each also a client
key): operator keys (`--operator-api-key-file`, PDSERVE_OPERATOR_API_KEYS) may set their
requests' priority and path and join their traceparent; admin keys (`--admin-api-key-file`,
PDSERVE_ADMIN_API_KEYS) may also call the /pdserve/ routes. A client key's priority, path and
traceparent are ignored, and it gets 403 on /pdserve/.

With no key at all the router is open, and everyone is trusted as an admin: on loopback only
(logged loudly); on any other address it refuses to start unless `--allow-unauthenticated`.
Keys are compared in constant time, as SHA-256 digests (equal lengths, whatever was sent), and
never logged; one revoked with `pdserve revoke-key` is refused by every router of the cluster
within a second (router/shared/state.py). `/health` is always open (probes carry no key);
`/metrics` is open unless `--no-public-metrics`.

Each key also salts the prefix caches (`--cache-salt-per-key`, the default): its requests carry
a cache salt derived from the key, so two keys never share a cached prefix, nor learn from
`cached_tokens` or the routing what the other's prompts were.
"""

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from pdserve.settings.base import ConfigError
from pdserve.settings.router import (
    ADMIN_ENV,
    ENV,
    OPERATOR_ENV,
    RouterSettings,
    is_loopback,
    open_refusal,
    unauthenticated_allowed,
)
from router.http.errors import ErrorKind, OpenAIError, invalid_api_key
from router.shared.state import key_digest

ALWAYS_OPEN = ("/health",)
SALT_CONTEXT = b"pdserve cache salt\0"  # a key's cache salt is not its revocation digest

log = logging.getLogger("pdserve.router")


class KeyRole(IntEnum):
    """What a caller may do; each role may do what the ones below it may."""

    CLIENT = 0  # the OpenAI endpoints
    OPERATOR = 1  # ... with its own priority, path (x-pdserve-route) and trace
    ADMIN = 2  # ... and the /pdserve/ routes


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys(tuple):
    """Every key the router takes (client, operator and admin ones), in order: a tuple, so that
    it is true when there is any and `is_authorized` takes it as it takes a plain one; plus the
    keys' digests and which are operators' and admins'."""

    def __new__(cls, client=(), operator=(), admin=()):
        keys = super().__new__(cls, dict.fromkeys((*client, *operator, *admin)))
        keys.digests = tuple(_digest(key) for key in keys)
        keys.operator = frozenset(_digest(key) for key in (*operator, *admin))
        keys.admin = frozenset(_digest(key) for key in admin)
        return keys


def load_api_keys(settings: RouterSettings) -> ApiKeys:
    """The router's keys; with none, a ConfigError on an address other than loopback unless
    unauthenticated serving is allowed, else a warning."""
    keys = [key.strip() for key in settings.api_key]
    keys += _file_keys(settings.api_key_file, "--api-key-file")
    keys += _env_keys(ENV)
    operator = _file_keys(settings.operator_api_key_file, "--operator-api-key-file")
    admin = _file_keys(settings.admin_api_key_file, "--admin-api-key-file")
    loaded = ApiKeys(
        [k for k in keys if k],
        [k for k in operator + _env_keys(OPERATOR_ENV) if k],
        [k for k in admin + _env_keys(ADMIN_ENV) if k],
    )
    if not loaded:
        check_open(settings)
    return loaded


def _file_keys(path: str, flag: str) -> list[str]:
    if not path:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise ConfigError(f"{flag}: cannot read: {error.strerror}") from None
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _env_keys(name: str) -> list[str]:
    return [key.strip() for key in os.environ.get(name, "").split(",")]


def check_open(settings: RouterSettings) -> None:
    """A router with no key serves anyone who reaches it: refused on any address but loopback
    unless asked for (--allow-unauthenticated); logged loudly wherever it runs."""
    if not is_loopback(settings.host) and not unauthenticated_allowed(settings):
        raise ConfigError(open_refusal(f"--host {settings.host}"))
    log.warning(
        "no API key is set: the router on %s:%s serves anyone who reaches it, the /pdserve/ "
        "routes included (--api-key-file, %s)",
        settings.host,
        settings.port,
        ENV,
    )


def open_paths(settings: RouterSettings) -> tuple[str, ...]:
    return ALWAYS_OPEN + (("/metrics",) if settings.public_metrics else ())


def role_of(
    header: str | None, keys: tuple[str, ...], revoked: frozenset[str] = frozenset()
) -> KeyRole | None:
    """The role of the key in an `Authorization` header; None for no key, an unknown one, or a
    revoked one (`revoked`: SHA-256 hex digests of keys revoked cluster-wide)."""
    scheme, _, key = (header or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    given = _digest(key)
    digests = getattr(keys, "digests", None)
    if digests is None:
        digests = tuple(_digest(k) for k in keys)
    # Every key is compared, whatever matches, and as digests of one length: the time taken
    # says nothing about the keys, nor about their lengths.
    known = sum(hmac.compare_digest(given, digest) for digest in digests) > 0
    if not known or key_digest(key) in revoked:
        return None
    if given in getattr(keys, "admin", ()):
        return KeyRole.ADMIN
    if given in getattr(keys, "operator", ()):
        return KeyRole.OPERATOR
    return KeyRole.CLIENT


def is_authorized(
    header: str | None, keys: tuple[str, ...], revoked: frozenset[str] = frozenset()
) -> bool:
    """`revoked`: SHA-256 digests of keys revoked cluster-wide (`pdserve revoke-key`)."""
    return role_of(header, keys, revoked) is not None


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as far as the router trusts it."""

    role: KeyRole
    cache_salt: str = ""  # its key's salt of the prefix caches ("": none)

    @property
    def steers(self) -> bool:
        """It may set its priority and path, and continue its own trace."""
        return self.role >= KeyRole.OPERATOR


def caller_of(state, headers) -> Caller:
    """The caller of a request, from the app's state (its keys, settings and revoked keys) and
    the request's headers. With no key configured everyone is an admin (an open router)."""
    keys = state.api_keys
    if not keys:
        return Caller(KeyRole.ADMIN)
    header = headers.get("authorization")
    revoked = state.sync.revoked if state.sync is not None else frozenset()
    role = role_of(header, keys, revoked)
    if role is None:  # an open path: no key, or a wrong one
        return Caller(KeyRole.CLIENT, _salt("") if state.settings.cache_salt_per_key else "")
    key = header.partition(" ")[2].strip()
    return Caller(role, _salt(key) if state.settings.cache_salt_per_key else "")


def _salt(key: str) -> str:
    """A key's cache salt: a digest of it (no other key's, nor its revocation digest)."""
    return hashlib.sha256(SALT_CONTEXT + key.encode()).hexdigest()


def request_salt(caller: Caller, asked: str | None) -> str:
    """What salts a request's prompts in the prefix caches: its key's salt and its own
    `cache_salt` together, so that a request's salt partitions its key's cache but never
    reaches another key's ("": neither, an unsalted request)."""
    if not asked:
        return caller.cache_salt
    return hashlib.sha256(f"{caller.cache_salt}\0{asked}".encode()).hexdigest()


def require(state, headers, role: KeyRole) -> None:
    """A 403 unless the request's key has `role` (or more)."""
    if caller_of(state, headers).role >= role:
        return
    configured = state.api_keys.admin if role == KeyRole.ADMIN else state.api_keys.operator
    hint = "" if configured else "; this router has none"
    flag = "--admin-api-key-file" if role == KeyRole.ADMIN else "--operator-api-key-file"
    raise forbidden(f"this route needs an {role.name.lower()} API key ({flag}){hint}")


def forbidden(message: str) -> OpenAIError:
    return OpenAIError(403, message, ErrorKind.INVALID_API_KEY)


def unauthorized(header: str | None) -> OpenAIError:
    message = (
        "You didn't provide an API key: send it as 'Authorization: Bearer KEY'."
        if not header
        else "Incorrect API key provided."
    )
    return invalid_api_key(message)
