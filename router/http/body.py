"""Reading a request body: JSON, read no further than the app's limit, within a deadline, and
within what all the bodies being read at once may hold (security review L11: a client that
sends its body slowly, or never ends it, holds its bytes no longer than BODY_TIMEOUT_S, and
many such clients no more than MAX_BODIES_BYTES in all)."""

import asyncio
import json
import re

from fastapi import Request

from router.http.errors import body_timeout, body_too_large, invalid_request, too_many_requests

BODY_TIMEOUT_S = 60.0  # from the first byte of the body to its last
MAX_BODIES_BYTES = 1 << 30  # the bodies being read, all connections together
SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: in no text


class BodyBytes:
    """The bytes of the request bodies being read now, all connections together."""

    def __init__(self, limit: int = MAX_BODIES_BYTES) -> None:
        self.limit = limit
        self.held = 0

    def take(self, count: int) -> None:
        """Count `count` more bytes held; a 429 when that is past the limit."""
        if self.held + count > self.limit:
            raise too_many_requests("the router is reading too many request bodies at once", 1)
        self.held += count


async def read_json(request: Request):
    """The body as JSON, read no further than `app.state.max_body_bytes()` (a 413 beyond:
    router/app.py's body_limit), within BODY_TIMEOUT_S (a 408 beyond) and the app's
    `BodyBytes` (a 429 beyond)."""
    limit = request.app.state.max_body_bytes()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    bodies: BodyBytes = request.app.state.bodies
    raw = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for part in request.stream():
                bodies.take(len(part))
                raw += part
                if len(raw) > limit:
                    raise body_too_large(limit)
    except TimeoutError:
        raise body_timeout(BODY_TIMEOUT_S) from None
    finally:
        bodies.held -= len(raw)
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except ValueError as error:  # bad JSON or UTF-8, an integer over 4300 digits, NaN
        raise invalid_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # json's C parser nests a call per array or object
        raise invalid_request("the request body is not valid JSON: nested too deeply") from None
    if b"\\u" in raw or not raw.isascii():  # where a lone surrogate can hide
        _check_text(body)
    return body


def _check_text(body) -> None:
    """A 400 for a string that holds a lone UTF-16 surrogate: json reads one from a \\ud800
    escape, or from its UTF-8 bytes, but it is no text: the tokenizer refuses it, and a response
    that echoes it cannot be encoded (a 500 otherwise)."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if SURROGATE.search(item):
                raise invalid_request(
                    "the request body holds a lone UTF-16 surrogate (U+D800 to U+DFFF), "
                    "which is not text"
                )
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def json_body(*models) -> dict:
    """A route's request body in its OpenAPI description (`openapi_extra`): the routes read
    their bodies themselves (read_json), so FastAPI knows them only from this. Each model's
    JSON schema keeps its own `$defs` (its `$ref`s are relative to it). The description is not
    served (router/app.py), it is what scripts/fuzz_router.py draws requests from."""
    schemas = [model.model_json_schema(by_alias=True) for model in models]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _not_json(constant: str):
    """NaN, Infinity and -Infinity: Python's json reads them, JSON has no such values."""
    raise ValueError(f"{constant} is not a JSON value")
