"""Every HTTP route of the router, fuzzed from the app's own OpenAPI description (issue 45,
security review M5): scripts/fuzz_router.py's requests (its routes, query parameters and
described bodies, with values at and past every bound, junk JSON and bytes that are not JSON)
against the app over fake workers. None may be answered 5xx, and every 4xx has OpenAI's error
body. A few derandomized examples per route here (a few seconds); the script runs more."""

import importlib.util
import logging
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"post /v1/": 60, "post /": 25}  # by prefix; other routes: DEFAULT_EXAMPLES
DEFAULT_EXAMPLES = 10


def load_script():
    spec = importlib.util.spec_from_file_location(
        "fuzz_router", ROOT / "scripts" / "fuzz_router.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FUZZ = load_script()
APP = FUZZ.fuzz_app()
OPERATIONS = FUZZ.operations(APP)


def examples_for(operation) -> int:
    key = f"{operation.method} {operation.path}"
    return next((n for prefix, n in EXAMPLES.items() if key.startswith(prefix)), DEFAULT_EXAMPLES)


def test_the_openapi_description_lists_every_route_and_the_bodies():
    routes = {operation.name for operation in OPERATIONS}
    assert {
        "GET /health",
        "GET /metrics",
        "GET /v1/models",
        "GET /version",
        "GET /pdserve/workers",
        "GET /pdserve/roles",
        "POST /pdserve/roles",
        "POST /tokenize",
        "POST /detokenize",
        "POST /v1/completions",
        "POST /v1/chat/completions",
    } <= routes
    paths = APP.openapi()["paths"]
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["properties"]["top_k"]["maximum"] == 2**31 - 1


@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda operation: operation.name)
def test_no_route_answers_a_5xx_to_any_request(operation, caplog):
    caplog.set_level(logging.ERROR)  # every ignored field logs a warning
    counts, failures = Counter(), []
    FUZZ.fuzz(APP, operation, examples_for(operation), None, counts, failures)
    assert failures == [], failures[:3]
    assert sum(counts.values()) >= 1
    if operation.path.startswith("/v1/") and operation.method == "post":
        statuses = {status for (_, status) in counts}
        assert 200 in statuses and 400 in statuses  # both served and refused requests drawn
