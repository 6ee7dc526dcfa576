"""Sends one streaming request to an OpenAI-compatible server and records what it saw.

Timing follows `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py): the clock
starts just before the request is sent and each SSE `data:` line is timestamped as it arrives.
TTFT ends at the first chunk with generated text (content, or reasoning); from then on every
chunk with a `choices` entry is a token step, as in vLLM (an empty text is still a token: EOS,
a special token, half a UTF-8 character), giving one ITL gap each; E2E ends at the last such
chunk (the trailing usage chunk and `[DONE]` do not count). Deliberate differences from vLLM:
- vLLM also starts TTFT at an empty chunk, such as the chat stream's opening role-only delta,
  which adds a ~0 s ITL sample per chat request; here leading empty chunks are skipped;
- vLLM marks a request successful once one chunk came; here a stream that ends without
  `[DONE]`, carries an `error` object, or has malformed data is a failed request.
Every failure (HTTP status, connection, timeout, malformed SSE, an error in the stream) is
recorded in the record's `error`; nothing is raised.
"""

import asyncio
import json
import os
import time
from dataclasses import dataclass

import httpx

from pdserve.bench.records import RequestRecord
from pdserve.bench.workload import BenchRequest

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class StreamError(Exception):
    """The server broke the streaming protocol or reported an error inside the stream."""


def make_http_client() -> httpx.AsyncClient:
    """One client for the whole benchmark: no connection cap (the runner sets concurrency) and
    no httpx timeouts (each request has its own total deadline); OPENAI_API_KEY if set."""
    key = os.environ.get("OPENAI_API_KEY")
    return httpx.AsyncClient(
        timeout=None,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        headers={"Authorization": f"Bearer {key}"} if key else None,
    )


async def first_model(http: httpx.AsyncClient, url: str, timeout: float = 10.0) -> str:
    """The first model id the server lists at /v1/models."""
    response = await http.get(url.rstrip("/") + "/v1/models", timeout=timeout)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{url}/v1/models lists no model")
    return models[0]["id"]


@dataclass
class Target:
    """Where and how to send: the server's base URL, the model, and the endpoint."""

    url: str
    model: str
    endpoint: str = "completions"  # or "chat"
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens

    def body(self, request: BenchRequest) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = request.messages or [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


async def send(
    http: httpx.AsyncClient, target: Target, request: BenchRequest, timeout: float
) -> RequestRecord:
    """Stream one request, giving up after `timeout` seconds, and return its record; never
    raises."""
    record = RequestRecord(
        prompt_tokens=request.prompt_tokens,
        max_tokens=request.max_tokens,
        cacheable_tokens=request.cacheable_tokens,
    )
    url = target.url.rstrip("/") + ENDPOINT_PATHS[target.endpoint]
    try:
        async with asyncio.timeout(timeout):
            record.send_time = time.perf_counter()
            async with http.stream("POST", url, json=target.body(request)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {' '.join(text.split())[:300]}"
                else:
                    await _read_stream(response, record)
    except TimeoutError:
        record.error = f"timed out after {timeout:.3g} s"
    except StreamError as error:
        record.error = str(error)
    except Exception as error:  # connection resets, protocol errors...: recorded, never raised
        record.error = f"{type(error).__name__}: {error}"
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
    last = record.send_time
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments, event/id fields
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break  # skips the loop's else
        now = time.perf_counter()
        chunk = _parse(data)
        if chunk.get("usage"):
            record.usage = chunk["usage"]
        if chunk.get("choices") and (record.ttft is not None or _generated_text(chunk)):
            if record.ttft is None:
                record.ttft = now - record.send_time
            else:
                record.itl.append(now - last)
            last = now
            record.output_chunks += 1
            record.output_text += _content(chunk["choices"][0])
    else:
        raise StreamError("stream ended without [DONE]")
    if record.ttft is None:
        raise StreamError("stream carried no generated text")
    record.e2e = last - record.send_time


def _parse(data: str) -> dict:
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise StreamError(f"malformed SSE data: {data[:200]!r}") from None
    if not isinstance(chunk, dict):
        raise StreamError(f"malformed SSE data: {data[:200]!r}")
    if "error" in chunk or chunk.get("object") == "error":
        error = chunk.get("error", chunk)
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"error in stream: {message}")
    return chunk


def _generated_text(chunk: dict) -> str:
    choice = chunk["choices"][0]
    delta = choice.get("delta") or {}
    return _content(choice) or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _content(choice: dict) -> str:
    """The reply's text in one chunk (a reasoning model's reasoning is not part of it)."""
    if "delta" in choice:  # chat completions
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""
