"""The router's one fake worker, against router/workers/handle.py's WorkerHandle Protocol, and a
fake clock. No engine, no network: `generate` streams the chunks it was given (then raises its
error, if any: with no chunks it is a worker that is down), `health` and `stats` answer from a
table of replies the test edits (a missing reply is a worker not listening), and every call is
recorded. `router_over` assembles the router's real request steps over such workers, and
`app_with_workers` the whole app; FakeTokenizer stands in for the router's tokenizer."""

import asyncio
import contextlib
import json
from dataclasses import dataclass

import grpc

from pdserve.core.kinds import Role
from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from router import app as router_app
from router.flow.accounting import Accounting
from router.flow.relay import Relay
from router.flow.retries import Starter
from router.http.errors import invalid_request, worker_unavailable
from router.metrics import RouterMetrics
from router.workers.choice import WorkerChoice
from router.workers.load import WorkerLoad
from router.workers.policies import RoundRobin
from router.workers.pool import WorkerPool


class FakeReplies:
    """What fake worker processes answer, by address: their Health, and their Stats (a reply,
    or a gRPC status code the call fails with)."""

    def __init__(self) -> None:
        self.health: dict[str, worker_pb2.HealthReply] = {}
        self.stats: dict[str, worker_pb2.StatsReply | grpc.StatusCode] = {}


class FakeWorker:
    """A worker as the router sees it (a WorkerHandle)."""

    def __init__(
        self,
        name: str,
        role: str = Role.DECODE,
        chunks=(),
        error=None,
        *,
        address: str | None = None,
        flex: bool = False,
        kv_pool: str = "",
        host_id: str = "",
        data_parallel_ranks: int = 1,
        replies: FakeReplies | None = None,
    ) -> None:
        self.address = address or f"{name}:50051"
        self.role, self.flex = role, flex
        self.identity = worker_pb2.HealthReply(
            worker_id=name,
            role=Role.FLEX if flex else role,
            max_model_len=4096,
            max_num_seqs=16,
            kv_address=f"{name}:6000",
            kv_transport="grpc",
            host_id=host_id,
            device="cpu",
            tensor_parallel_size=1,
            kv_compatibility="smollm2-float32",
            kv_pool=kv_pool,  # with host_id, its host KV pool ("": none)
            data_parallel_ranks=data_parallel_ranks,  # > 1: a data-parallel group's node
        )
        self.users = 0
        self.load = WorkerLoad()  # no report: the route estimate prices it like the cluster
        self.chunks = list(chunks)
        self.error = error
        self.replies = replies or FakeReplies()
        self.requests: list[worker_pb2.GenerateRequest] = []
        self.timeouts: list[float] = []
        self.cancelled: list[tuple[str, str]] = []  # (transfer id, reason)
        self.asked: worker_pb2.StatsRequest | None = None  # the last Stats question
        self.closed = False

    def reports(self, **fields) -> None:
        """Its Stats said so (StatsReply's fields)."""
        self.load.reported(worker_pb2.StatsReply(**fields))

    async def health(self, timeout: float = 5.0) -> worker_pb2.HealthReply:
        """Its reply in the table; when READY, it takes the identity the reply gives, as the
        real client does."""
        reply = self.replies.health.get(self.address)
        if reply is None:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE)
        if reply.state == worker_pb2.HealthReply.READY:
            self.identity, self.flex = reply, reply.role == Role.FLEX
            if not self.flex:
                self.role = reply.role
        return reply

    async def stats(
        self, request: worker_pb2.StatsRequest | None = None, timeout: float = 5.0
    ) -> worker_pb2.StatsReply:
        self.asked = request
        reply = self.replies.stats.get(self.address, grpc.StatusCode.UNAVAILABLE)
        if isinstance(reply, grpc.StatusCode):
            raise _rpc_error(reply)
        return reply

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float):
        self.requests.append(request)
        self.timeouts.append(timeout)
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error

    async def cancel_transfer(self, transfer_id: str, reason: str) -> None:
        await asyncio.sleep(0)  # a real call suspends
        self.cancelled.append((transfer_id, reason))

    @contextlib.contextmanager
    def in_use(self):
        self.users += 1
        try:
            yield self
        finally:
            self.users -= 1

    async def close(self) -> None:
        self.closed = True


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), code.name)


def answering(name: str, role: str = Role.DECODE) -> FakeWorker:
    """A worker that streams a whole two-chunk answer ("Hello world", 3 tokens)."""
    return FakeWorker(
        name,
        role,
        chunks=[
            worker_pb2.GenerateChunk(token_ids=[1, 2], text="Hello"),
            worker_pb2.GenerateChunk(token_ids=[3], text=" world", finish_reason="length"),
        ],
    )


def unavailable(name: str, role: str = Role.DECODE) -> FakeWorker:
    """A worker that is down: its calls fail before any chunk."""
    return FakeWorker(name, role, error=worker_unavailable(f"worker {name} is unavailable"))


class FakeClock:
    """Monotonic seconds that move only when the test advances them."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class RouterParts:
    """The router's real request steps over a pool of fake workers, as router/app.py makes
    them."""

    settings: RouterSettings
    pool: WorkerPool
    choice: WorkerChoice
    metrics: RouterMetrics
    starter: Starter
    accounting: Accounting
    relay: Relay


def router_over(*workers, settings: RouterSettings | None = None, policy=None) -> RouterParts:
    """`workers` as the pool's members; round-robin unless `policy` is given."""
    settings = settings or RouterSettings(model="m")
    pool = WorkerPool([])
    pool.workers = list(workers)
    choice = WorkerChoice(pool, policy or RoundRobin())
    metrics = RouterMetrics()
    accounting = Accounting(metrics, choice.policy.cache_lost)
    return RouterParts(
        settings,
        pool,
        choice,
        metrics,
        Starter(settings, pool, choice, metrics),
        accounting,
        Relay(accounting),
    )


class FakeTokenizer:
    """Stands in for router.flow.tokenization.PromptTokenizer: one token per character."""

    vocab_size = 0x110000

    def __init__(self, model: str, max_model_len=None) -> None:
        self.model = model

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def chat_ids(self, messages, *options) -> list[int]:
        return self.text_ids("".join(message.text() for message in messages))

    def chat(self, parsed) -> list[int]:
        return self.chat_ids(parsed.messages)

    def completion_prompts(self, parsed) -> list[list[int]]:
        return [self.text_ids(p) if isinstance(p, str) else p for p in parsed.prompts()]

    def detokenize(self, ids: list[int]) -> str:
        if bad := [i for i in ids if not 0 <= i < self.vocab_size]:  # as PromptTokenizer
            raise invalid_request(f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return "".join(chr(i) for i in ids)

    def token_strs(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]

    def token_text(self, token_id: int) -> str:
        return chr(token_id)


class AppWorker(FakeWorker):
    """A fake worker the assembled app serves from: one token ("h") per choice, with the
    logprobs and prompt logprobs asked for, and stats."""

    def __init__(self, name: str, role: str = "decode", **options) -> None:
        super().__init__(name, role, **options)
        self.identity.max_num_seqs = 256  # room for n=128
        self.flex = False

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float):
        self.requests.append(request)
        sampling = request.sampling
        for index in range(max(sampling.n, 1)):
            chunk = worker_pb2.GenerateChunk(
                index=index,
                token_ids=[104],
                text="h",
                finish_reason="length",
                prompt_tokens=len(request.prompt_token_ids),
            )
            if sampling.HasField("logprobs"):
                chunk.logprobs.append(position(104))
                chunk.cumulative_logprob = -0.5
            if index == 0 and sampling.HasField("prompt_logprobs"):
                prompt = request.prompt_token_ids
                chunk.prompt_logprobs.add()  # the first position has none
                chunk.prompt_logprobs.extend(position(token) for token in prompt[1:])
            yield chunk

    async def stats(self, request, timeout: float = 2.0) -> worker_pb2.StatsReply:
        return worker_pb2.StatsReply()


def position(token_id: int) -> worker_pb2.PositionLogprobs:
    """A position's logprobs: its own token, then a top one."""
    return worker_pb2.PositionLogprobs(
        entries=[
            worker_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, rank=1),
            worker_pb2.TokenLogprob(token_id=32, logprob=-1.5, rank=2),
        ]
    )


def app_with_workers(monkeypatch, *workers: FakeWorker, tokenizer=FakeTokenizer, **settings):
    """The assembled app over `workers` (one AppWorker when none is given), with no lifespan
    (nothing polls them): drive it with TestClient(app) outside a `with`, or httpx's
    ASGITransport. `tokenizer`: the class that stands for PromptTokenizer."""
    monkeypatch.setattr(router_app, "PromptTokenizer", tokenizer)
    app = router_app.create_app(RouterSettings(model="m", worker_addresses=[], **settings), "m")
    app.state.pool.workers = list(workers) or [AppWorker("decode-a")]
    return app


class FakeHttpClient:
    """One HTTP request to an app, as ASGI: the body, then http.disconnect once `leave()`."""

    def __init__(self, app, path: str, body: dict) -> None:
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self.messages = [{"type": "http.request", "body": json.dumps(body).encode()}]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }
        self.task = asyncio.create_task(app(scope, self.receive, self.send))

    async def receive(self) -> dict:
        if self.messages:
            return self.messages.pop(0)
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self.gone.set()

    def status(self) -> int | None:
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None
