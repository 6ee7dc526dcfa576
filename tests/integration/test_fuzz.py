"""Property-based fuzzing of both endpoints on a real router over real workers (hypothesis;
every route over fake workers: tests/unit/test_router_fuzz.py and scripts/fuzz_router.py):
bodies of every shape (right and wrong types, out-of-range values, unknown fields, non-JSON
bytes) never get a 5xx, and every error has OpenAI's body. Generated tokens are capped (the
router's --default-max-tokens 2, small max_tokens) so a few hundred cases run in seconds;
`PDSERVE_FUZZ_EXAMPLES=5000 pytest tests/integration/test_fuzz.py` runs more."""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.conftest import SERVED_MODEL, router_in_front_of
from tests.integration.http_client import HTTP

# CI runs the same 150 cases every time (derandomized); asking for more explores afresh.
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize="PDSERVE_FUZZ_EXAMPLES" not in os.environ,
    database=None,
    suppress_health_check=list(HealthCheck),
)
finite = st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry

junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | finite
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=8,
)
small_int = st.integers(min_value=-3, max_value=4)
# The worker protocol's int32/uint32/int64 edges and past them (security review M5).
edges = st.sampled_from([2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, -(2**63) - 1])
common = {
    "model": st.sampled_from([SERVED_MODEL, "other", ""]) | junk,
    "max_tokens": small_int | junk,
    "temperature": st.floats(min_value=-1, max_value=3) | junk,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | junk,
    "top_k": small_int | edges | junk,
    "min_tokens": small_int | edges | junk,
    "prompt_logprobs": small_int | edges | junk,
    "request_id": st.text(max_size=12) | junk,
    "seed": st.integers(min_value=-(2**64), max_value=2**64) | junk,
    "stop": st.lists(st.text(max_size=6), max_size=6) | st.text(max_size=6) | junk,
    "presence_penalty": st.floats(min_value=-3, max_value=3) | junk,
    "stream": st.booleans() | junk,
    "n": small_int | junk,
    "logprobs": small_int | edges | junk,
    "ignore_eos": st.booleans() | junk,
    "unknown_field": junk,
}
prompts = st.text(max_size=60) | st.lists(st.integers(-5, 60000), max_size=8) | junk
messages = (
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | junk},
            optional={"content": st.text(max_size=40) | junk, "name": junk},
        ),
        max_size=3,
    )
    | junk
)
completion_bodies = st.fixed_dictionaries({}, optional={**common, "prompt": prompts})
chat_bodies = st.fixed_dictionaries(
    {}, optional={**common, "messages": messages, "max_completion_tokens": small_int | junk}
)


@pytest.fixture(scope="module")
def fuzz_router(server, tmp_path_factory):
    with router_in_front_of(server, tmp_path_factory.mktemp("fuzz"), default_max_tokens=2) as url:
        yield url


def check(url: str, endpoint: str, body) -> None:
    if isinstance(body, bytes):
        response = HTTP.post(
            f"{url}/v1/{endpoint}",
            content=body,
            timeout=60,
            headers={"content-type": "application/json"},
        )
    else:
        response = HTTP.post(f"{url}/v1/{endpoint}", json=body, timeout=60)
    assert response.status_code < 500, (body, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


not_json = st.binary(max_size=40) | st.sampled_from(
    [b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"9" * 5000 + b"}", b'{"prompt": NaN}']
)


@FUZZ
@given(body=completion_bodies | not_json)
def test_completions_never_answer_5xx(fuzz_router, body):
    check(fuzz_router, "completions", body)


@FUZZ
@given(body=chat_bodies | not_json)
def test_chat_completions_never_answer_5xx(fuzz_router, body):
    check(fuzz_router, "chat/completions", body)
