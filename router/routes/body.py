"""Reading a request body: JSON, read no further than the app's limit."""

import json

from fastapi import Request

from router.errors import body_too_large, invalid_request


async def read_json(request: Request):
    """The body as JSON, read no further than `app.state.max_body_bytes()` (a 413 beyond:
    router/app.py's body_limit)."""
    limit = request.app.state.max_body_bytes()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise body_too_large(limit)
    try:
        return json.loads(raw, parse_constant=_not_json)
    except ValueError as error:  # bad JSON or UTF-8, an integer over 4300 digits, NaN
        raise invalid_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:  # json's C parser nests a call per array or object
        raise invalid_request("the request body is not valid JSON: nested too deeply") from None


def _not_json(constant: str):
    """NaN, Infinity and -Infinity: Python's json reads them, JSON has no such values."""
    raise ValueError(f"{constant} is not a JSON value")
