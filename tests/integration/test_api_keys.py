"""Client API keys on a real router (`pdserve router` in front of the session's workers), with
the real `openai` client: no key or a wrong one is a 401 with OpenAI's body (which the client
raises as AuthenticationError), a right one is served, /health stays open for probes, and
/metrics is closed when asked. Only an admin key may call the /pdserve/ routes, and two keys
never share a cached prefix on the real engines (each key salts its requests' prefix cache)."""

import openai
import pytest

from tests.integration.conftest import SERVED_MODEL, router_in_front_of
from tests.integration.http_client import HTTP

KEYS = ("sk-pdserve-test-1", "sk-pdserve-test-2")
ADMIN_KEY = "sk-pdserve-test-admin"
# Whole 128-token blocks of the CPU engine's prefix cache: several of them.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 40


@pytest.fixture(scope="module")
def guarded_router(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("api-keys")
    key_file, admin_file = folder / "keys", folder / "admin-keys"
    key_file.write_text("# keys for the test\n" + "\n".join(KEYS) + "\n")
    admin_file.write_text(ADMIN_KEY + "\n")
    with router_in_front_of(
        server,
        folder,
        api_key_file=str(key_file),
        admin_api_key_file=str(admin_file),
        public_metrics=False,
        # every request on the decode worker: its prefix cache answers cached_tokens
        route_policy="length",
        disaggregate_min_tokens=100_000,
    ) as url:
        yield url
    log = (folder / "router.log").read_text()
    assert KEYS[0] not in log and ADMIN_KEY not in log, "a key reached the log"


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=0)


def test_a_right_key_is_served_whole_and_streamed(guarded_router):
    reply = client(guarded_router, KEYS[1]).completions.create(
        model=SERVED_MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert reply.usage.completion_tokens >= 1
    stream = client(guarded_router, KEYS[0]).completions.create(
        model=SERVED_MODEL,
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == reply.choices[0].text


@pytest.mark.parametrize("key", ["sk-wrong", KEYS[0] + "x"])
def test_a_wrong_key_is_a_401_with_the_openai_body(guarded_router, key):
    with pytest.raises(openai.AuthenticationError) as caught:
        client(guarded_router, key).completions.create(
            model=SERVED_MODEL, prompt="Hi", max_tokens=2
        )
    error = caught.value.body
    assert error["code"] == "invalid_api_key" and key not in error["message"]


def test_no_key_is_a_401_naming_the_header(guarded_router):
    response = HTTP.post(
        f"{guarded_router}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2},
        timeout=30,
    )
    assert response.status_code == 401
    assert "Authorization" in response.json()["error"]["message"]
    assert HTTP.get(f"{guarded_router}/v1/models", timeout=10).status_code == 401


def test_health_stays_open_and_metrics_needs_an_operator_key_when_not_public(guarded_router):
    assert HTTP.get(f"{guarded_router}/health", timeout=10).status_code == 200
    assert HTTP.get(f"{guarded_router}/metrics", timeout=10).status_code == 401
    as_client = {"authorization": f"Bearer {KEYS[0]}"}
    assert HTTP.get(f"{guarded_router}/metrics", headers=as_client, timeout=10).status_code == 403
    metrics = HTTP.get(  # its labels name the workers: an operator's (or an admin's) to read
        f"{guarded_router}/metrics", headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
    )
    assert metrics.status_code == 200
    assert 'pdserve_errors_total{kind="invalid_api_key"}' in metrics.text


def test_only_an_admin_key_may_call_the_pdserve_routes(guarded_router):
    as_client = {"authorization": f"Bearer {KEYS[0]}"}
    refused = HTTP.post(
        f"{guarded_router}/pdserve/roles", json={"prefill": 0}, headers=as_client, timeout=10
    )
    assert refused.status_code == 403 and "admin API key" in refused.json()["error"]["message"]
    assert (
        HTTP.get(f"{guarded_router}/pdserve/workers", headers=as_client, timeout=10).status_code
        == 403
    )
    as_admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert (
        HTTP.get(f"{guarded_router}/pdserve/roles", headers=as_admin, timeout=10).status_code == 200
    )


def cached_tokens(url: str, key: str) -> int:
    reply = HTTP.post(
        f"{url}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0},
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] >= 2 * 128
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_two_keys_sending_the_same_prompt_never_share_its_cached_prefix(guarded_router):
    """Review M8: tenant B must not learn from cached_tokens that tenant A sent a prompt."""
    cached_tokens(guarded_router, KEYS[0])
    assert cached_tokens(guarded_router, KEYS[0]) >= 128  # one key: its own cache hits
    assert cached_tokens(guarded_router, KEYS[1]) == 0  # another key: nothing of the first's
