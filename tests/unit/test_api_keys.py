"""router/http/api_keys.py: where keys come from, how the header is checked, what stays open, what
each key's role may do, and that an open router serves on loopback only."""

import logging

import pytest
from fastapi.testclient import TestClient

from pdserve.settings.base import ConfigError
from pdserve.settings.router import ALLOW_UNAUTHENTICATED_ENV, RouterSettings
from router import app as router_app
from router.http import api_keys
from router.http.api_keys import (
    ADMIN_ENV,
    ENV,
    OPERATOR_ENV,
    KeyRole,
    is_authorized,
    load_api_keys,
    open_paths,
    role_of,
    unauthorized,
)
from router.shared.state import key_digest
from tests.fakes import FakeTokenizer


def settings(**fields) -> RouterSettings:
    return RouterSettings(model="m", **fields)


def test_keys_come_from_the_flag_the_file_and_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv(ENV, "sk-env-1, ,sk-env-2")
    keys = load_api_keys(settings(api_key=["sk-flag"], api_key_file=str(key_file)))
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2")


def test_no_key_anywhere_means_an_open_router(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert load_api_keys(settings()) == ()


def test_an_unreadable_key_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--api-key-file"):
        load_api_keys(settings(api_key_file=str(tmp_path / "missing")))


@pytest.mark.parametrize(
    "header, ok",
    [
        ("Bearer sk-2", True),
        ("bearer sk-1", True),
        ("Bearer  sk-1 ", True),
        ("Bearer sk-3", False),
        ("Bearer sk-", False),
        ("Bearer ", False),
        ("Basic sk-1", False),
        ("sk-1", False),
        ("", False),
        (None, False),
    ],
)
def test_the_bearer_header_is_checked(header, ok):
    assert is_authorized(header, ("sk-1", "sk-2")) is ok


def test_the_refusal_is_a_401_with_the_openai_body_and_never_echoes_the_key():
    error = unauthorized("Bearer sk-secret-guess")
    assert error.status == 401
    body = error.body()["error"]
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
    assert "sk-secret-guess" not in body["message"]
    assert "Authorization" in unauthorized(None).message


def test_health_is_always_open_metrics_only_when_public():
    assert open_paths(settings()) == ("/health", "/metrics")
    assert open_paths(settings(public_metrics=False)) == ("/health",)


def test_keys_are_compared_as_digests_of_one_length(monkeypatch):
    """hmac.compare_digest on values of unequal lengths returns at once: comparing the sent key
    itself would reveal the length of the keys (review L3)."""
    lengths = []
    real = api_keys.hmac.compare_digest

    def recording(a, b):
        lengths.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(api_keys.hmac, "compare_digest", recording)
    assert not is_authorized("Bearer short", ("a-much-longer-key", "k"))
    assert is_authorized("Bearer k", ("a-much-longer-key", "k"))
    assert lengths and all(a == b == 32 for a, b in lengths)


def test_operator_and_admin_keys_come_from_their_files_and_variables(tmp_path, monkeypatch):
    for name in (ENV, OPERATOR_ENV, ADMIN_ENV):
        monkeypatch.delenv(name, raising=False)
    operators, admins = tmp_path / "operators", tmp_path / "admins"
    operators.write_text("sk-op\n")
    admins.write_text("# admins\nsk-admin\n")
    monkeypatch.setenv(ADMIN_ENV, "sk-admin-env")
    keys = load_api_keys(
        settings(
            api_key=["sk-client"],
            operator_api_key_file=str(operators),
            admin_api_key_file=str(admins),
        )
    )
    assert keys == ("sk-client", "sk-op", "sk-admin", "sk-admin-env")  # each also a client key
    assert role_of("Bearer sk-client", keys) == KeyRole.CLIENT
    assert role_of("Bearer sk-op", keys) == KeyRole.OPERATOR
    assert role_of("Bearer sk-admin", keys) == role_of("Bearer sk-admin-env", keys) == KeyRole.ADMIN
    assert role_of("Bearer sk-other", keys) is None
    revoked = frozenset({key_digest("sk-admin")})
    assert role_of("Bearer sk-admin", keys, revoked) is None
    with pytest.raises(ConfigError, match="--admin-api-key-file"):
        load_api_keys(settings(admin_api_key_file=str(tmp_path / "missing")))


def no_keys(monkeypatch) -> None:
    for name in (ENV, OPERATOR_ENV, ADMIN_ENV, ALLOW_UNAUTHENTICATED_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "router.example"])
def test_with_no_key_the_router_refuses_to_start_off_loopback(monkeypatch, host):
    """Review M7: a typo in a key Secret's name must not publish an open LLM API."""
    no_keys(monkeypatch)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    with pytest.raises(ConfigError, match="--allow-unauthenticated"):
        router_app.create_app(settings(host=host, worker_addresses=[]), "models/m")
    router_app.create_app(settings(host=host, allow_unauthenticated=True), "models/m")
    monkeypatch.setenv(ALLOW_UNAUTHENTICATED_ENV, "1")
    router_app.create_app(settings(host=host), "models/m")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_with_no_key_on_loopback_the_router_serves_and_says_so_loudly(monkeypatch, caplog, host):
    no_keys(monkeypatch)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        router_app.create_app(settings(host=host, worker_addresses=[]), "models/m")
    assert any("no API key is set" in r.getMessage() for r in caplog.records)


def guarded_app(monkeypatch, tmp_path, admin: bool = True):
    no_keys(monkeypatch)
    monkeypatch.setattr(router_app, "PromptTokenizer", FakeTokenizer)
    admins = tmp_path / "admins"
    admins.write_text("sk-admin\n" if admin else "")
    return router_app.create_app(
        settings(api_key=["sk-client"], admin_api_key_file=str(admins), worker_addresses=[]),
        "models/m",
    )


def test_a_client_key_on_the_admin_routes_is_a_403_an_admin_key_is_served(monkeypatch, tmp_path):
    client = {"authorization": "Bearer sk-client"}
    admin = {"authorization": "Bearer sk-admin"}
    with TestClient(guarded_app(monkeypatch, tmp_path)) as http:
        refused = http.post("/pdserve/roles", json={"prefill": 0, "decode": 1}, headers=client)
        assert refused.status_code == 403
        assert "admin API key" in refused.json()["error"]["message"]
        assert http.get("/pdserve/roles", headers=client).status_code == 403
        assert http.get("/pdserve/workers", headers=client).status_code == 403
        assert http.get("/v1/models", headers=client).status_code == 200  # a client's route
        assert http.post("/pdserve/roles", json={"standby": 1}, headers=admin).status_code == 400
        assert http.get("/pdserve/roles", headers=admin).status_code == 200
        assert http.get("/pdserve/workers", headers=admin).status_code == 200
        assert http.get("/pdserve/roles").status_code == 401  # no key: as before


def test_with_keys_but_no_admin_key_the_admin_routes_are_closed(monkeypatch, tmp_path):
    with TestClient(guarded_app(monkeypatch, tmp_path, admin=False)) as http:
        refused = http.get("/pdserve/roles", headers={"authorization": "Bearer sk-client"})
    assert refused.status_code == 403 and "has none" in refused.json()["error"]["message"]


def test_up_refuses_before_starting_a_router_that_would_refuse_to_start():
    """`pdserve up` checks what its router would (review M7): beyond loopback, a key in the
    environment its actor inherits, or unauthenticated serving allowed."""
    from pdserve.cluster.up import check_router_keys

    everywhere = settings(host="0.0.0.0")
    with pytest.raises(ConfigError, match="router.host 0.0.0.0: no API key is set"):
        check_router_keys(everywhere, environ={})
    check_router_keys(everywhere, environ={ADMIN_ENV: "sk-admin"})
    check_router_keys(everywhere, environ={ALLOW_UNAUTHENTICATED_ENV: "1"})
    check_router_keys(settings(host="127.0.0.1"), environ={})
