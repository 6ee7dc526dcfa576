"""FakeOpenAIServer: a stand-in for an OpenAI-compatible server (not the pdserve router) that
streams OpenAI SSE chunks with known delays and fails on request, for the bench tests.

The prompt picks the fake's behaviour: "http-error" (503), "stream-error" (an error object after
two tokens), "malformed" (bad JSON), "truncate" (closes without [DONE]), "hang" (never answers),
"eos" (the last token has empty text, as EOS does in vLLM); anything else streams max_tokens
tokens, the first after TTFT_S and the rest ITL_S apart, each with a text of its own (" r{n}t{i}",
n counting the fake's requests). Its usage counts one token per word of the prompt (of every chat
message), and, unless made with report_cached=False, reports as cached the longest prefix (in
words) this prompt shares with an earlier one: a prefix cache that holds prompts, not replies.
Every request it answers is logged (arrival, body, reply text, finish).
"""

import asyncio
import json
import threading
import time
from dataclasses import dataclass

from aiohttp import web

TTFT_S = 0.2
ITL_S = 0.05


@dataclass
class Received:
    """One request the fake answered: perf_counter times, the JSON body, the text it streamed."""

    arrived: float
    body: dict
    reply: str = ""
    finished: float | None = None


class FakeOpenAIServer:
    """A fake OpenAI-compatible streaming server on 127.0.0.1 (ephemeral port), in a thread;
    its first token after `ttft_s`, the next ones every `itl_s`."""

    def __init__(self, report_cached: bool = True, ttft_s: float = TTFT_S, itl_s: float = ITL_S):
        self.report_cached = report_cached
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.log: list[Received] = []
        self._prompts: list[list[str]] = []  # the fake prefix cache, in words
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> "FakeOpenAIServer":
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        received = Received(time.perf_counter(), await request.json())
        body = received.body
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        if "http-error" in prompt:
            return web.json_response({"error": {"message": "fake overload"}}, status=503)
        self.log.append(received)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, chat, prompt, body["max_tokens"], received)
        finally:
            self.in_flight -= 1
            received.finished = time.perf_counter()

    def _usage(self, body: dict, completion_tokens: int) -> dict:
        texts = [m["content"] for m in body["messages"]] if "messages" in body else [body["prompt"]]
        words = " ".join(texts).split()
        usage = {"prompt_tokens": len(words), "completion_tokens": completion_tokens}
        if self.report_cached:
            cached = max((_common_prefix(words, seen) for seen in self._prompts), default=0)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        self._prompts.append(words)
        return usage

    async def _stream(self, request, chat, prompt, max_tokens, received) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(data) -> None:
            await response.write(
                f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
            )

        def token_chunk(text: str, finish_reason: str | None) -> dict:
            choice = (
                {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            )
            return {"object": "chunk", "choices": [choice | {"finish_reason": finish_reason}]}

        if "hang" in prompt:
            await asyncio.sleep(30)
        if chat:  # like vLLM: a role-only chunk with empty content opens the stream
            await event(
                {
                    "object": "chunk",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                }
            )
        await response.write(b": ping\n\n")  # an SSE comment the client must skip
        await asyncio.sleep(self.ttft_s)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.itl_s)
            last = i == max_tokens - 1
            if last and "eos" in prompt:  # like vLLM: EOS is a token with empty text
                await event(token_chunk("", "stop"))
            else:
                text = f" r{len(self.log)}t{i}"
                received.reply += text
                await event(token_chunk(text, "length" if last else None))
            if i == 1 and "stream-error" in prompt:
                await event({"error": {"message": "fake engine died", "code": 500}})
                return response
            if i == 1 and "malformed" in prompt:
                await event('{"choices": [')
                return response
            if i == 1 and "truncate" in prompt:
                return response
        usage = self._usage(received.body, max_tokens)
        await event({"object": "chunk", "choices": [], "usage": usage})
        await event("[DONE]")
        return response


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
