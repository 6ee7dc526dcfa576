"""A chaos load: clients that send a steady mix of requests to two routers over one cluster
while its parts are killed (scripts/chaos.py's soak, tests/integration/test_cluster_ray.py's CI
chaos), and count what became of each.

Each of `Load.client`'s loops sends one request after another to the routers in turn: whole and
streamed responses, n=1 and n=2, and aborts (a stream left after its first token). A request
whose router died under it is retried once at the other router (as a load balancer would); one
that fails otherwise is counted by its error code (`failures`). The goal is none failed.
"""

import asyncio
import json
import random
import time
from collections import Counter

import httpx


class Load:
    """The clients and what became of their requests."""

    def __init__(
        self, routers: list[str], model: str, timeout_s: float, pause_s: float = 0.0
    ) -> None:
        self.routers = routers
        self.pause_s = pause_s  # a client's wait after each request (0: one after another)
        self.model = model
        self.timeout_s = timeout_s
        self.outcomes: Counter = Counter()
        self.failures: Counter = Counter()
        self.failed_at: list[tuple[float, str]] = []  # (time.monotonic(), "code: message")
        self.latencies: dict[str, list[float]] = {"calm": [], "chaos": []}
        self.phase = "calm"
        self.stop = asyncio.Event()

    async def client(self, number: int) -> None:
        rng = random.Random(number)
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            turn = number
            while not self.stop.is_set():
                turn += 1
                kind = rng.choice(["whole", "whole", "stream", "stream", "n2", "abort"])
                started = time.monotonic()
                outcome = await self.one(http, kind, turn, rng)
                self.outcomes[outcome] += 1
                if outcome in ("succeeded", "retried") and kind == "whole":
                    self.latencies[self.phase].append(time.monotonic() - started)
                if self.pause_s:
                    await asyncio.sleep(self.pause_s)

    async def one(self, http, kind: str, turn: int, rng) -> str:
        body = {
            "model": self.model,
            "prompt": f"Request {turn}: the weather in city {rng.randint(1, 999)} is",
            "max_tokens": rng.choice([8, 16, 32]),
            "temperature": 0,
        }
        if kind == "n2":
            body.update(n=2, temperature=0.8, seed=turn)
        deadline = time.monotonic() + self.timeout_s
        for attempt, router in enumerate([self.routers[turn % 2], self.routers[(turn + 1) % 2]]):
            try:
                if kind in ("stream", "abort"):
                    await self.streamed(http, router, body, abort=kind == "abort")
                else:
                    reply = await http.post(f"{router}/v1/completions", json=body)
                    if reply.status_code != 200:
                        return self.failed(reply)
                    choices = reply.json()["choices"]
                    if len(choices) != body.get("n", 1) or not all(c["text"] for c in choices):
                        return self.count("a choice missing or empty", f"{choices}")
                return "aborted" if kind == "abort" else ("retried" if attempt else "succeeded")
            except httpx.TimeoutException:
                return "deadline passed"
            except (httpx.TransportError, _Failed) as error:  # its router died: the other one
                if isinstance(error, _Failed):
                    return self.failed(error.reply, error.line)
                if time.monotonic() > deadline:
                    return "deadline passed"
        return self.count("both routers unreachable", "")

    async def streamed(self, http, router: str, body: dict, abort: bool) -> None:
        async with http.stream(
            "POST", f"{router}/v1/completions", json={**body, "stream": True}
        ) as reply:
            if reply.status_code != 200:
                await reply.aread()
                raise _Failed(reply)
            async for line in reply.aiter_lines():
                if abort and line.startswith("data: {"):
                    return  # leaves the stream: the router aborts it on the workers
                if line.startswith("data: {") and '"error"' in line:
                    raise _Failed(reply, line)

    def failed(self, reply, line: str = "") -> str:
        try:
            error = json.loads(line.removeprefix("data: ") or reply.text)["error"]
            code, message = error["code"], error["message"]
        except Exception:
            code, message = f"http {reply.status_code}", line
        return self.count(code, message)

    def count(self, code: str, message: str) -> str:
        """A failed request: counted by its code, and when it failed, for a reader to put
        beside the events."""
        self.failures[code] += 1
        self.failed_at.append((time.monotonic(), f"{code}: {message}"[:300]))
        return "failed"


class _Failed(Exception):
    def __init__(self, reply, line: str = "") -> None:
        super().__init__(line)
        self.reply = reply
        self.line = line
