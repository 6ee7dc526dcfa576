"""The bench client, runner, reports and command against FakeOpenAIServer, a stand-in (not the
pdserve router) that streams OpenAI SSE chunks with known delays and fails on request.

The prompt picks the fake's behaviour: "http-error" (503), "stream-error" (an error object after
two tokens), "malformed" (bad JSON), "truncate" (closes without [DONE]), "hang" (never answers),
"eos" (the last token has empty text, as EOS does in vLLM); anything else streams max_tokens
tokens, the first after TTFT_S and the rest ITL_S apart, each with a text of its own (" r{n}t{i}",
n counting the fake's requests). Its usage counts one token per word of the prompt (of every chat
message), and, unless made with report_cached=False, reports as cached the longest prefix (in
words) this prompt shares with an earlier one: a prefix cache that holds prompts, not replies.
Every request it answers is logged (arrival, body, reply text, finish).
"""

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass

import pytest
from aiohttp import web

from pdserve.bench import command
from pdserve.bench.client import Target, make_http_client, send
from pdserve.bench.metrics import Slo, summarize
from pdserve.bench.report import plot_cdfs, plot_goodput_vs_rate, table, write_json
from pdserve.bench.runner import run
from pdserve.bench.workload import BenchRequest

pytestmark = pytest.mark.timeout(60)

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


@pytest.fixture(scope="module")
def fake_server():
    fake = FakeOpenAIServer().start()
    yield fake
    fake.stop()


def send_one(url: str, endpoint: str, prompt: str, max_tokens: int = 5, timeout: float = 10.0):
    async def go():
        async with make_http_client() as http:
            target = Target(url, "fake-model", endpoint)
            return await send(http, target, BenchRequest(3, max_tokens, prompt=prompt), timeout)

    return asyncio.run(go())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("prompt", ["hello there", "eos"])
def test_timings_match_injected_delays(fake_server, endpoint, prompt):
    record = send_one(fake_server.url, endpoint, prompt, max_tokens=5)
    assert record.error is None
    assert TTFT_S <= record.ttft < TTFT_S + 1.0
    # The chat stream's leading empty role chunk is not a token; a later empty one (EOS) is.
    assert record.output_chunks == 5 and len(record.itl) == 4
    # From the server's usage (the workload said 3 prompt tokens), and the streamed text.
    assert record.output_tokens == 5 and record.input_tokens == len(prompt.split())
    assert record.output_text == fake_server.log[-1].reply
    assert 0.6 * ITL_S <= sum(record.itl) / 4 < ITL_S + 0.5
    assert record.e2e == pytest.approx(record.ttft + sum(record.itl))
    assert record.tpot == pytest.approx((record.e2e - record.ttft) / 4)


@pytest.mark.parametrize(
    "prompt, timeout, expected",
    [
        ("http-error", 10.0, "HTTP 503"),
        ("stream-error", 10.0, "fake engine died"),
        ("malformed", 10.0, "malformed SSE"),
        ("truncate", 10.0, "without [DONE]"),
        ("hang", 0.5, "timed out"),
    ],
)
def test_errors_are_recorded_not_raised(fake_server, prompt, timeout, expected):
    record = send_one(fake_server.url, "completions", prompt, timeout=timeout)
    assert record.error is not None and expected in record.error
    assert not record.ok and record.tpot is None


def test_connection_error_is_recorded():
    record = send_one("http://127.0.0.1:9", "completions", "hello")  # port 9 (discard): refused
    assert record.error and "Connect" in record.error


def test_open_loop_run_reports_and_files(fake_server, tmp_path):
    prompts = ["a", "b", "http-error", "c"]
    requests = [BenchRequest(1, 3, prompt=p) for p in prompts]
    target = Target(fake_server.url, "fake-model")
    records, duration = asyncio.run(
        run(requests, target, offsets=[0.0, 0.1, 0.2, 0.3], progress=False)
    )
    assert [r.ok for r in records] == [True, True, False, True]
    assert duration >= 0.3 + TTFT_S + 2 * ITL_S
    sends = [r.send_time - records[0].send_time for r in records]
    assert all(0.1 * i - 0.02 <= s < 0.1 * i + 0.5 for i, s in enumerate(sends))

    summary = summarize(records, duration, Slo(ttft=5.0))
    assert (summary.completed, summary.failed, summary.good_requests) == (3, 1, 3)
    assert summary.slo_attainment == pytest.approx(
        0.75
    )  # the failed request stays in the denominator
    text = table(summary, records)
    assert "Goodput" in text and "HTTP 503" in text

    write_json(tmp_path / "out" / "bench.json", {"url": fake_server.url}, summary, records)
    document = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert document["summary"]["completed"] == 3 and len(document["requests"]) == 4
    assert document["requests"][2]["error"].startswith("HTTP 503")
    plot_cdfs(tmp_path / "plots" / "cdf.png", records)
    plot_goodput_vs_rate(tmp_path / "plots" / "goodput.png", [(1.0, 0.9), (2.0, 1.5)], "ttft<=5s")
    for name in ("cdf.png", "goodput.png"):
        assert (tmp_path / "plots" / name).read_bytes().startswith(b"\x89PNG")


def test_closed_loop_keeps_concurrency(fake_server):
    fake_server.max_in_flight = 0
    requests = [BenchRequest(1, 2, prompt=f"p{i}") for i in range(6)]
    records, duration = asyncio.run(
        run(requests, Target(fake_server.url, "fake-model"), concurrency=2, progress=False)
    )
    assert len(records) == 6 and all(r.ok for r in records)
    assert fake_server.max_in_flight == 2
    assert duration >= 3 * (TTFT_S + ITL_S)  # three rounds of two


def test_deadline_stops_sending_and_cuts_in_flight(fake_server):
    requests = [
        BenchRequest(1, 2, prompt="hang"),
        BenchRequest(1, 2, prompt="x"),
        BenchRequest(1, 2, prompt="y"),
    ]
    records, duration = asyncio.run(
        run(
            requests,
            Target(fake_server.url, "fake-model"),
            offsets=[0.0, 0.0, 5.0],
            max_duration=0.6,
            progress=False,
        )
    )
    assert len(records) == 2  # the third was due after the deadline: never sent
    assert "timed out" in records[0].error and records[1].ok
    assert 0.5 <= duration < 3.0


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    command.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_bench_command_end_to_end(fake_server, tmp_path, capsys):
    args = bench_args(
        "--url",
        fake_server.url,
        "--endpoint",
        "chat",
        "--num-requests",
        "4",
        "--request-rate",
        "20",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--slo",
        "ttft=2s,tpot=500ms",
        "--no-progress",
        "--output-json",
        str(tmp_path / "bench.json"),
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert args.run(args) == 0
    assert "Goodput (req/s)" in capsys.readouterr().out
    document = json.loads((tmp_path / "bench.json").read_text())
    assert document["config"]["model"] == "fake-model"  # asked from /v1/models
    assert document["summary"]["completed"] == 4 and document["summary"]["good_requests"] == 4
    assert (tmp_path / "plots" / "latency_cdf.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--slo", "ttft=fast"], "bad SLO item"),
        (["--input-len", "ten"], "bad length"),
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--workload", "trace"], "--trace FILE"),
        (["--workload", "trace", "--trace", "/nonexistent/trace.jsonl"], "No such file"),
    ],
)
def test_bench_command_bad_input_exits_2(argv, message, capsys):
    args = bench_args("--url", "http://127.0.0.1:9", "--no-progress", *argv)
    assert args.run(args) == 2
    error = capsys.readouterr().err
    assert error.startswith("pdserve bench: error:") and message in error and error.count("\n") == 1
