"""router/api_keys.py: where keys come from, how the header is checked, what stays open."""

import pytest

from pdserve.settings.base import ConfigError
from pdserve.settings.router import RouterSettings
from router.api_keys import ENV, is_authorized, load_api_keys, open_paths, unauthorized


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
