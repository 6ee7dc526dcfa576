"""How the app answers what no route answered itself: an endpoint's OpenAIError, an HTTP error
of the framework's (404, 405), an unexpected exception (500, details in the log only), and a
call without a valid API key (401)."""

import logging
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from router.http.api_keys import is_authorized, unauthorized
from router.http.errors import ErrorCode, ErrorKind, OpenAIError, internal_error, invalid_request

log = logging.getLogger("pdserve.router")


async def openai_error(request: Request, error: OpenAIError):
    """An endpoint's own error (the generation endpoints answer theirs themselves, counting
    them in the metrics)."""
    return JSONResponse(error.body(), status_code=error.status)


async def http_error(request: Request, error: StarletteHTTPException):
    body = OpenAIError(error.status_code, str(error.detail), ErrorKind.INVALID_REQUEST).body()
    return JSONResponse(body, status_code=error.status_code)


async def validation_error(request: Request, error: RequestValidationError):
    """A query parameter FastAPI could not read (`/pdserve/workers?fresh=x`): a 400 naming it,
    in OpenAI's body (not FastAPI's 422 and its own shape)."""
    first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(part) for part in first["loc"][1:]) or None
    message = f"Invalid value for '{param}': {first['msg']}" if param else first["msg"]
    body = invalid_request(message, param=param, code=ErrorCode.INVALID_VALUE)
    return JSONResponse(body.body(), status_code=body.status)


async def client_gone(request: Request, error: ClientDisconnect):
    """The client left while it sent its body: nobody reads the answer, nothing to log."""
    return Response(status_code=499)


async def unexpected_error(request: Request, error: Exception):
    """The details go to the log, under an id the client gets; not to the client."""
    error_id = uuid.uuid4().hex[:12]
    log.exception("unexpected error %s on %s", error_id, request.url.path)
    request.app.state.metrics.errors.labels(ErrorKind.INTERNAL).inc()
    return JSONResponse(internal_error(error_id).body(), status_code=500)


HANDLERS = {
    OpenAIError: openai_error,
    StarletteHTTPException: http_error,
    RequestValidationError: validation_error,
    ClientDisconnect: client_gone,
    Exception: unexpected_error,
}


class ApiKeyGuard:
    """Every path but the app's open ones needs one of its API keys. A plain ASGI middleware:
    the one `app.middleware("http")` makes (Starlette's BaseHTTPMiddleware) passes each chunk of
    a streamed response through a memory stream of its own, a cost on every token."""

    def __init__(self, app, state) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state, request = self.state, Request(scope)
        header = request.headers.get("authorization")
        revoked = state.sync.revoked if state.sync is not None else frozenset()
        if request.url.path in state.unguarded or is_authorized(header, state.api_keys, revoked):
            return await self.app(scope, receive, send)
        error = unauthorized(header)
        state.metrics.errors.labels(error.kind).inc()
        await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
