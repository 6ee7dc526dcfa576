"""vLLM's own P/D behind one OpenAI address: the protocol of vLLM's toy proxy for its
NixlConnector (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), written here so
that scripts/compare_vllm.py can run vLLM's P/D as a system (`--systems vllm-nixl`).

    python scripts/vllm_pd_proxy.py --port 8000 --prefill http://127.0.0.1:8100 \
        --decode http://127.0.0.1:8200 [--timeout 300]

Each /v1/completions or /v1/chat/completions request goes twice:
1. to the prefill server, with max_tokens (and max_completion_tokens, if sent) 1, no stream and
   `kv_transfer_params.do_remote_decode`: it computes the prompt's KV and keeps its blocks for
   the decode server to read; its JSON reply carries `kv_transfer_params` (where the blocks are);
2. to the decode server, the client's request as sent plus those `kv_transfer_params`: it reads
   the blocks over NIXL and generates; its answer (an SSE stream or JSON) goes back as it comes.
A reply without `kv_transfer_params` is an error (502), not a silent recompute on the decode
server. Upstream errors come back with their own status and body; an unreachable or late
upstream is a 502 or 504. Every upstream call has a deadline (--timeout: connect, and each
read of a reply or a stream chunk; the prefill call as a whole). /health is 200 when both
servers' /health are.
"""

import argparse
import asyncio
import contextlib
import copy
import json
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HEALTH_TIMEOUT_S = 5.0
REMOTE_DECODE_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What the prefill server is told: decode elsewhere (vLLM's NixlConnector reads these)."""


class UpstreamError(Exception):
    """An upstream server's reply that goes back to the client as it is."""

    def __init__(self, status_code: int, body: bytes, content_type: str = "application/json"):
        super().__init__(f"HTTP {status_code}")
        self.status_code, self.body, self.content_type = status_code, body, content_type

    def response(self) -> Response:
        return Response(self.body, self.status_code, media_type=self.content_type)


def prefill_body(body: dict) -> dict:
    """The client's request as the prefill server gets it: one token, no stream, decode
    elsewhere."""
    prefill = copy.deepcopy(body)
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["stream"] = False
    prefill.pop("stream_options", None)  # vLLM refuses stream_options without a stream
    prefill["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    return prefill


def decode_body(body: dict, prefill_reply: dict) -> dict:
    """The client's request as the decode server gets it: as sent, plus where the prefill
    server keeps the prompt's KV (its reply's `kv_transfer_params`)."""
    params = prefill_reply.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise UpstreamError(502, error_body("the prefill server sent no kv_transfer_params"))
    return copy.deepcopy(body) | {"kv_transfer_params": params}


def error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "proxy_error"}}).encode()


def error_response(message: str, status_code: int) -> Response:
    return Response(error_body(message), status_code, media_type="application/json")


class Proxy:
    """The two servers and one HTTP client to both."""

    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float):
        self.prefill_url, self.decode_url = prefill_url.rstrip("/"), decode_url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def complete(self, request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error_response("the body is not JSON", 400)
        if not isinstance(body, dict):
            return error_response("the body is not a JSON object", 400)
        try:
            reply = await self._prefill(request.url.path, body)
            return await self._decode(request.url.path, decode_body(body, reply))
        except UpstreamError as error:
            return error.response()
        except (TimeoutError, httpx.TimeoutException) as error:
            return error_response(f"upstream timed out: {error!r}", 504)
        except httpx.HTTPError as error:
            return error_response(f"upstream failed: {error!r}", 502)

    async def _prefill(self, path: str, body: dict) -> dict:
        async with asyncio.timeout(self.timeout_s):
            response = await self.http.post(self.prefill_url + path, json=prefill_body(body))
        if response.status_code != 200:
            raise UpstreamError(response.status_code, response.content, _content_type(response))
        try:
            return response.json()
        except json.JSONDecodeError:
            raise UpstreamError(502, error_body("the prefill server's reply is not JSON")) from None

    async def _decode(self, path: str, body: dict) -> Response:
        upstream = self.http.build_request("POST", self.decode_url + path, json=body)
        response = await self.http.send(upstream, stream=True)
        if response.status_code != 200 or not body.get("stream"):
            try:
                content = await response.aread()
            finally:
                await response.aclose()
            return Response(content, response.status_code, media_type=_content_type(response))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:  # the client's disconnect too: the decode server sees its stream closed
                await response.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await self.http.aclose()

    async def health(self, _: Request) -> Response:
        async def healthy(url: str) -> bool:
            try:
                response = await self.http.get(url + "/health", timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError:
                return False
            return response.status_code == 200

        states = await asyncio.gather(healthy(self.prefill_url), healthy(self.decode_url))
        return JSONResponse(
            {"prefill": states[0], "decode": states[1]}, 200 if all(states) else 503
        )

    async def models(self, _: Request) -> Response:
        try:
            response = await self.http.get(self.decode_url + "/v1/models")
        except httpx.HTTPError as error:
            return error_response(f"upstream failed: {error!r}", 502)
        return Response(response.content, response.status_code, media_type="application/json")


def _content_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "application/json")


def app(proxy: Proxy) -> Starlette:
    return Starlette(
        routes=[
            Route("/v1/completions", proxy.complete, methods=["POST"]),
            Route("/v1/chat/completions", proxy.complete, methods=["POST"]),
            Route("/v1/models", proxy.models, methods=["GET"]),
            Route("/health", proxy.health, methods=["GET"]),
        ],
        lifespan=proxy.lifespan,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds per upstream call (default 300)"
    )
    args = parser.parse_args()
    proxy = Proxy(args.prefill, args.decode, args.timeout)
    uvicorn.run(app(proxy), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
