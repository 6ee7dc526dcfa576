"""The generation endpoints called straight from the app, past FastAPI's stack.

A short request's CPU in the router went a fifth to the layers every request crosses in FastAPI:
Starlette's two error layers and FastAPI's exit stack (each a coroutine, two of them wrapping
`send`), the route table, and per route the dependency solving and two more exit stacks
(docs/benchmarking.md). The generation endpoints need none of it: they read their own body
(router/http/body.py), answer their own errors in OpenAI's JSON and take no dependency. So
`RouterApp` hands a POST to them straight to the endpoint, with the server's own `send` (a
streamed event is one call, not one per layer). What the layers did for them is kept: the API-key
check is the same guard (router/http/error_handlers.py's ApiKeyGuard), and an exception the
endpoint did not expect is the 500 the app's handler answers. FastAPI's routes for them stay:
they describe the API (OpenAPI) and answer their other methods (405).
"""

from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from router.http import error_handlers as errors


class RouterApp(FastAPI):
    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.direct_routes: dict[str, ASGIApp] = {}  # path -> what serves a POST to it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            direct = self.direct_routes.get(scope["path"])
            if direct is not None:
                scope["app"] = self  # as Starlette sets it: `request.app.state`
                return await direct(scope, receive, send)
        await super().__call__(scope, receive, send)


def direct_route(endpoint) -> ASGIApp:
    """`endpoint` (an async function of a Request that returns its Response) as an ASGI app."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except Exception as error:  # answered as the app's handler answers it
            response = await errors.unexpected_error(request, error)
        await response(scope, receive, send)

    return app


def direct_routes(routes, state) -> dict[str, ASGIApp]:
    """The POST routes of `routes` (an APIRouter's), each behind the API-key guard when the app
    has keys."""
    direct = {
        route.path: direct_route(route.endpoint)
        for route in routes.routes
        if "POST" in route.methods
    }
    if state.api_keys:
        return {path: errors.ApiKeyGuard(app, state=state) for path, app in direct.items()}
    return direct
