"""Fuzz every HTTP route of the router (issue 45; security review M5, L8): requests drawn from
the app's own OpenAPI description (each route and method, its query parameters, and the JSON
bodies the generation and tokenize routes describe: router/http/body.py's json_body), mixed
with values at and past every bound, wrong types, junk JSON, bytes that are not JSON, and the
router's own headers. The app runs in this process over fake workers
(tests/fakes.py: one token per choice, logprobs as asked), so what is fuzzed is
the router's own handling: no answer may be a 5xx, and every 4xx has OpenAI's error body.

    python scripts/fuzz_router.py [--examples 500] [--seed N] [--model FOLDER]

--examples per route (each generation route gets 4x as many). It prints how many requests of
each route got each status, and exits 1 after printing each failing request. The unit tier
runs a few examples of every route (tests/unit/test_router_fuzz.py); the integration tier
fuzzes the two generation routes on a real router and engine (tests/integration/test_fuzz.py).
"""

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as with_seed
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

SERVED_MODEL = "m"
# Integers every int field is tried with: the protocol's int32/uint32/int64 edges and past them.
INT_EDGES = [0, 1, -1, -2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63) - 1]
FLOAT_EDGES = [0.0, -0.0, 1e-300, -1.0, 1e308, -1e308, 2.0000001]
# A value is of its schema's type but 1 time in 20 (junk then); a required field is left out, and
# a field nobody knows added, 1 time in 20. (One value of the 20, not 0 or 19: Hypothesis draws
# the ends of a range far more often.)
ONE_IN_20 = st.integers(0, 19).map(lambda i: i == 7)
MAX_FIELDS = 5  # optional fields a body sets at most (more would nearly always hold a bad one)
GENERATION_WEIGHT = 4  # the generation routes get this many times the examples

finite = st.floats(allow_nan=False, allow_infinity=False)
junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from(INT_EDGES)
    | finite
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)
not_json = st.binary(max_size=40) | st.sampled_from(
    [
        b"",
        b"{",
        b"[" * 5000 + b"]" * 5000,
        b'{"prompt": NaN}',
        b'{"n": ' + b"9" * 5000 + b"}",
        b"\xff\xfe{}",
        '{"prompt": "\ud800"}'.encode("utf-8", "surrogatepass"),
    ]
)
# The router's own request headers (router/flow/admission.py, router/flow/route_choice.py,
# router/http/generation.py), with right and wrong values. A deadline the client sets and
# the router cannot meet is a 504 by design, so the timeouts drawn are long or malformed.
HEADERS = {
    "x-pdserve-route": st.sampled_from(
        ["local", "disaggregated", "stay-on-prefill", "", "sideways"]
    ),
    "x-pdserve-priority": st.sampled_from(["0", "-5", "7", "x", "", str(2**64), "1e3"]),
    "x-pdserve-timeout": st.sampled_from(
        ["30", "600", "60", "0", "-1", "nan", "inf", "1e309", "x"]
    ),
    "x-pdserve-timing": st.just("1"),
    "traceparent": st.sampled_from(["00-" + "a" * 32 + "-" + "b" * 16 + "-01", "junk", ""]),
    "authorization": st.sampled_from(["Bearer x", "Basic y", ""]),
}


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values for a JSON schema: mostly of its type, at and past its bounds, sometimes junk."""
    typed = _typed(schema, defs)
    return ONE_IN_20.flatmap(lambda rare: junk if rare else typed)


def _typed(schema: dict, defs: dict) -> st.SearchStrategy:
    if "$ref" in schema:
        return _typed(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_typed(option, defs) for option in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return _integers(schema)
    if kind == "number":
        return _numbers(schema)
    if kind == "string":
        return _strings(schema)
    if kind == "array":
        return _arrays(schema, defs)
    if kind == "object":
        return _objects(schema, defs)
    return junk


def _integers(schema: dict) -> st.SearchStrategy:
    low = schema.get("minimum", schema.get("exclusiveMinimum", -6) + 1)
    high = schema.get("maximum", schema.get("exclusiveMaximum", 10**6 + 1) - 1)
    inside = st.integers(low, min(high, low + 300))
    edges = st.sampled_from(sorted({low - 1, low, high, high + 1, *INT_EDGES}))
    return st.one_of(inside, inside, inside, inside, edges)


def _numbers(schema: dict) -> st.SearchStrategy:
    low = schema.get("minimum", schema.get("exclusiveMinimum", -1e6))
    high = schema.get("maximum", schema.get("exclusiveMaximum", 1e6))
    inside = st.floats(low, high, allow_nan=False, exclude_min=True, exclude_max=True)
    edges = st.sampled_from([low, high, low - 0.5, high + 0.5, *FLOAT_EDGES])
    return st.one_of(inside, inside, inside, inside, edges)


def _strings(schema: dict) -> st.SearchStrategy:
    shortest, longest = schema.get("minLength", 0), schema.get("maxLength")
    if "pattern" in schema:
        inside = st.from_regex(schema["pattern"], fullmatch=True).filter(
            lambda text: longest is None or len(text) <= longest
        )
    else:
        inside = st.text(min_size=shortest, max_size=max(shortest, min(longest or 40, 40)))
    edges = [st.text(max_size=3)] + ([] if longest is None else [st.just("x" * (longest + 1))])
    return st.one_of(inside, inside, inside, inside, *edges)


def _arrays(schema: dict, defs: dict) -> st.SearchStrategy:
    items = _typed(schema.get("items", {}), defs)
    shortest, longest = schema.get("minItems", 0), schema.get("maxItems")
    inside = st.lists(items, min_size=shortest, max_size=max(shortest, min(longest or 4, 4)))
    edges = [st.just([])]
    if longest is not None and longest <= 2048:
        edges.append(items.map(lambda item: [item] * (longest + 1)))
    return st.one_of(*[inside] * 8, *edges)


def _objects(schema: dict, defs: dict) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    if not properties:  # dict[str, Any] and the like
        return st.dictionaries(st.text(max_size=8), junk, max_size=4)
    required = [name for name in schema.get("required", []) if name in properties]
    optional = sorted(set(properties) - set(required))

    @st.composite
    def objects(draw):
        names = set(required)
        if required and draw(ONE_IN_20):
            names.discard(draw(st.sampled_from(required)))  # a required field left out
        if optional:
            names |= draw(st.sets(st.sampled_from(optional), max_size=MAX_FIELDS))
        body = {}
        for name in sorted(names):
            hint = HINTS.get(name)
            value = draw(hint) if hint is not None else draw(from_schema(properties[name], defs))
            body[name] = value
        if draw(ONE_IN_20):
            body[draw(st.text(min_size=1, max_size=8))] = draw(junk)  # a field nobody knows
        return body

    return objects()


# Fields whose schema alone would make nearly every request a 404 or a 400 that stops short.
HINTS = {
    "model": st.sampled_from([SERVED_MODEL, SERVED_MODEL, None, "other"]),
    "max_tokens": st.sampled_from([1, 2, 5, 0, -1, None, 2**32]),
    "max_completion_tokens": st.sampled_from([1, 3, 0, None, 2**31]),
    "temperature": st.sampled_from([1.0, 0.7, 0.0, 2.5, None, "1"]),
}


@dataclass
class Operation:
    """One route and method, and the requests drawn for it."""

    method: str
    path: str
    requests: st.SearchStrategy  # of (query params, body bytes or None, headers)

    @property
    def name(self) -> str:
        return f"{self.method.upper()} {self.path}"


def operations(app) -> list[Operation]:
    """Every route of the app's OpenAPI description, with its requests' strategy."""
    described = []
    for path, methods in app.openapi()["paths"].items():
        for method, operation in methods.items():
            described.append(Operation(method, path, _requests(method, path, operation)))
    return described


def _requests(method: str, path: str, operation: dict) -> st.SearchStrategy:
    params = {
        parameter["name"]: _query_value(parameter.get("schema", {}))
        for parameter in operation.get("parameters", [])
        if parameter["in"] == "query"
    }
    query = st.fixed_dictionaries({}, optional=params)
    content = operation.get("requestBody", {}).get("content", {}).get("application/json")
    if content is not None:
        schema = content["schema"]
        defs = {}
        for part in schema.get("anyOf", [schema]):
            defs.update(part.get("$defs", {}))
        body = st.one_of(*[from_schema(schema, defs).map(_json)] * 4, junk.map(_json), not_json)
    elif method == "post":  # a body the route reads itself, undescribed (/pdserve/roles)
        counts = junk | st.integers(-2, 3)
        roles = st.fixed_dictionaries({}, optional={"prefill": counts, "decode": counts})
        body = st.one_of(roles.map(_json), junk.map(_json), not_json)
    else:
        body = st.none()
    headers = st.just({})
    if path.startswith("/v1/"):  # a few of the router's headers
        names = st.sets(st.sampled_from(sorted(HEADERS)), max_size=2)
        headers = names.flatmap(
            lambda chosen: st.fixed_dictionaries({h: HEADERS[h] for h in chosen})
        )
    return st.tuples(query, body, headers)


def _query_value(schema: dict) -> st.SearchStrategy:
    typed = _typed(schema, {}).map(lambda value: json.dumps(value).strip('"'))
    return typed | st.text(max_size=6)


def _json(value) -> bytes:
    return json.dumps(value).encode()


def fuzz_app(model: str | None = None):
    """The router's app over a fake decode and a fake prefill worker (every path a request may
    be sent on can be taken), with no lifespan; its tokenizer is `model`'s (a folder), or a
    fake one (a token per character) without one."""
    from pdserve.settings.router import RouterSettings
    from router import app as router_app
    from tests.fakes import AppWorker, FakeTokenizer

    settings = RouterSettings(model=SERVED_MODEL, worker_addresses=[])
    if model is not None:
        app = router_app.create_app(settings, model)
    else:
        with mock.patch.object(router_app, "PromptTokenizer", FakeTokenizer):
            app = router_app.create_app(settings, "m")
    app.state.pool.workers = [AppWorker("decode-a"), AppWorker("prefill-a", role="prefill")]
    return app


def send(client, operation: Operation, request) -> tuple[int, str | None]:
    """Send one drawn request; its status and, when it breaks the rules, why."""
    query, body, headers = request
    headers = {**headers, "content-type": "application/json"}
    response = client.request(
        operation.method, operation.path, params=query, content=body, headers=headers
    )
    status = response.status_code
    if status >= 500:
        return status, f"a {status}: {response.text[:300]}"
    if status >= 400 and status != 499:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return status, f"a {status} without OpenAI's error body: {response.text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return status, f"a {status} whose error body is not OpenAI's: {error}"
    return status, None


def fuzz(app, operation: Operation, examples: int, seed: int | None, counts: Counter, failures):
    """Run `examples` requests of `operation`; count each status, keep each failure."""
    from fastapi.testclient import TestClient

    client = TestClient(app, raise_server_exceptions=False)

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=seed is None,
        suppress_health_check=list(HealthCheck),
        phases=["generate"],  # every failure is reported as drawn, not shrunk
    )
    @given(request=operation.requests)
    def run(request):
        status, failure = send(client, operation, request)
        counts[operation.name, status] += 1
        if failure is not None:
            failures.append((operation.name, request, failure))

    if seed is not None:
        run = with_seed(seed)(run)
    run()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="requests per route")
    parser.add_argument("--seed", type=int, help="explore from this seed (default: the CI set)")
    parser.add_argument(
        "--model", help="a model folder whose tokenizer the router uses (default: a fake one)"
    )
    args = parser.parse_args()
    import logging

    logging.disable(logging.WARNING)  # every refused body logs its ignored fields
    app = fuzz_app(args.model)
    counts, failures = Counter(), []
    for operation in operations(app):
        weight = (
            GENERATION_WEIGHT
            if operation.path.startswith("/v1/") and operation.method == "post"
            else 1
        )
        fuzz(app, operation, args.examples * weight, args.seed, counts, failures)
        statuses = {
            status: n for (name, status), n in sorted(counts.items()) if name == operation.name
        }
        print(
            f"{operation.name:28} {sum(statuses.values()):6} requests: "
            + ", ".join(f"{status} x{n}" for status, n in statuses.items()),
            flush=True,
        )
    total = sum(counts.values())
    server_errors = sum(n for (_, status), n in counts.items() if status >= 500)
    print(f"{total} requests, {server_errors} answered 5xx, {len(failures)} failures")
    for name, request, failure in failures[:20]:
        print(f"FAILED {name}: {failure}\n  request: {request!r:.500}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
