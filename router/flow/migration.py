"""Migration: a decode worker lost mid-stream (UNAVAILABLE after some tokens) is marked down,
and another decode worker continues every choice of the request that had not finished, each
from what the client already has of it: the client sees one stream per choice, indexes kept,
no token twice or missing, usage counted once.

A choice continues in one of two ways:

- From its tokens: the prompt plus the tokens relayed for it, computed there as prompt, with
  max_tokens (and min_tokens) reduced by as many. Greedy output is what an undisturbed run
  gives; unseeded sampling goes on drawing from the same distributions.
- By replay, when it is seeded and sampled: vLLM 0.32 gives each seeded request its own
  torch.Generator, seeded from SamplingParams.seed in its model runner and advanced by every
  token it samples, and has no way to hand that state to another engine; a continuation would
  draw from the start of the seed's stream at a later position, tokens the seed does not
  define. So the choice runs again from the prompt with its own seed (seed + its index, as the
  worker's fan-out seeds it), the tokens already relayed are checked against the replay and
  passed over, and the stream goes on after them: the seeded sequence, paid for by decoding the
  relayed tokens again. A replay that samples another token than was relayed (numerics that
  differ between batches) ends the request with a 502, never with tokens the seed did not give.

A request's continuations all go to one worker, merged as the worker merges n choices
(pdserve/core/fan_out.py).
"""

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field

from opentelemetry import trace

from pdserve.core.fan_out import fan_out
from pdserve.protocol import worker_pb2
from router.flow.request_run import RequestRun
from router.http.errors import ErrorKind, OpenAIError, worker_failed
from router.metrics import RouterMetrics
from router.workers.choice import WorkerChoice
from router.workers.data_parallel import on_rank
from router.workers.handle import WorkerHandle
from router.workers.pool import TAKES_REQUESTS, WorkerPool

log = logging.getLogger("pdserve.router")
MAX_MIGRATIONS = 2  # times a request may move on after its decode worker was lost mid-stream
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature samples greedily, seed or not


@dataclass
class Relayed:
    """What the client has of one choice so far."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0  # of the relayed text: all a seeded replay compares (a count, not a
    # string grown by += per token, which copied the whole text each time)
    logprob: float = 0.0  # the relayed tokens' own logprobs, summed (best_of ranks the total)
    finished: bool = False

    def add(self, chunk: worker_pb2.GenerateChunk) -> None:
        self.token_ids.extend(chunk.token_ids)
        self.text_chars += len(chunk.text)
        if chunk.logprobs:  # each position's own token comes first in its entries (protocol)
            self.logprob += sum(p.entries[0].logprob for p in chunk.logprobs if p.entries)
        self.finished = bool(chunk.finish_reason)


async def migrating(
    run: RequestRun,
    request: worker_pb2.GenerateRequest,
    first: worker_pb2.GenerateChunk,
    chunks,
    pool: WorkerPool,
    choice: WorkerChoice,
    metrics: RouterMetrics,
    worker_wait_s: float,
):
    """The request's chunks after `first`, from `chunks` (from the run's attempt's decode
    worker) and, each time its decode worker is lost, from the next one (up to MAX_MIGRATIONS;
    with none live, waiting up to `worker_wait_s` for one, within the request's deadline)."""
    relayed = [Relayed() for _ in range(run.choices)]
    relayed[first.index].add(first)
    current = chunks
    worker = run.decode_worker
    lost_at = None
    try:
        while True:
            try:
                async for chunk in current:
                    if lost_at is not None:
                        gap = time.monotonic() - lost_at
                        metrics.migration_gap.observe(gap)
                        log.info("request %s resumed %.3f s later", run.request_id, gap)
                        lost_at = None
                    relayed[chunk.index].add(chunk)
                    yield chunk
                return
            except OpenAIError as error:
                if error.kind != ErrorKind.WORKER_UNAVAILABLE or run.migrations >= MAX_MIGRATIONS:
                    raise
                lost_at = time.monotonic()
                pool.mark_down(worker)
                await current.aclose()
                await pool.wait_for_live(TAKES_REQUESTS, min(worker_wait_s, run.time_left()))
                run.migrations += 1
                metrics.migrations.inc()
                lost, worker = worker, choice.pick(TAKES_REQUESTS)
                current = continuation(run, request, relayed, lost, worker)
                log.warning(
                    "request %s (%d choices): %s after %d tokens; continuing on %s%s",
                    run.request_id,
                    run.choices,
                    error.message,
                    sum(len(one.token_ids) for one in relayed),
                    worker.identity.worker_id,
                    " by seeded replay" if replays(request.sampling) else "",
                )
    finally:
        await current.aclose()


def replays(sampling: worker_pb2.SamplingParams) -> bool:
    """Whether a lost choice is replayed from the prompt (seeded sampling) rather than
    continued from its tokens."""
    return sampling.HasField("seed") and sampling.temperature >= GREEDY_BELOW


def continuation(
    run: RequestRun,
    request: worker_pb2.GenerateRequest,
    relayed: list[Relayed],
    lost: WorkerHandle | None,
    worker: WorkerHandle,
):
    """The rest of every unfinished choice on `worker`, a decode worker other than the `lost`
    one (local path: it computes the prompt, and the relayed tokens, itself), within the
    request's remaining time."""
    lost_id = lost.identity.worker_id if lost is not None else ""
    trace.get_current_span().add_event(
        "pdserve.migration", {"pdserve.from": lost_id, "pdserve.to": worker.identity.worker_id}
    )
    timeout = run.time_left()
    streams = [
        functools.partial(
            _continued, worker, _rest(run, request, index, choice), index, choice, timeout
        )
        for index, choice in enumerate(relayed)
        if not choice.finished
    ]
    return _merged(streams)


def _rest(
    run: RequestRun, request: worker_pb2.GenerateRequest, index: int, choice: Relayed
) -> worker_pb2.GenerateRequest:
    """One choice's request to the next worker: alone (n = 1), from its own tokens or, when it
    replays, from the prompt with the seed it sampled with."""
    rest = worker_pb2.GenerateRequest()
    rest.CopyFrom(request)
    rest.ClearField("kv")
    rest.sampling.ClearField("prompt_logprobs")  # the client has them already
    rest.sampling.ClearField("n")
    rest.request_id = f"{run.request_id}-m{run.migrations}"
    if run.choices > 1:
        rest.request_id += f"-c{index}"
    if replays(request.sampling):
        rest.sampling.seed = request.sampling.seed + index
        return rest
    rest.prompt_token_ids.extend(choice.token_ids)
    rest.sampling.max_tokens -= len(choice.token_ids)
    rest.sampling.min_tokens = max(0, rest.sampling.min_tokens - len(choice.token_ids))
    return rest


async def _merged(streams):
    async with contextlib.aclosing(fan_out(streams)) as chunks:
        async for _, chunk in chunks:
            if chunk is not None:
                yield chunk


async def _continued(
    worker, rest: worker_pb2.GenerateRequest, index: int, choice: Relayed, timeout: float
):
    """Choice `index`'s chunks from `worker`, numbered as the client knows it; a replay's with
    what was relayed already passed over (None for a chunk passed over whole: the merge starts
    the other choices at a stream's first item, not when its replay has caught up), and a
    cumulative logprob that counts every token."""
    replay = _Replay(choice, index) if replays(rest.sampling) else None
    async for chunk in worker.generate(on_rank(worker, rest), timeout=timeout):
        chunk.index = index
        if replay is not None:
            chunk = replay.past_relayed(chunk)
        elif chunk.HasField("cumulative_logprob"):
            chunk.cumulative_logprob += choice.logprob
        yield chunk


class _Replay:
    """A seeded choice's replay, checked against what was relayed of it."""

    def __init__(self, relayed: Relayed, index: int) -> None:
        self.relayed = relayed
        self.index = index
        self.tokens = 0  # replayed so far
        self.chars = 0

    def past_relayed(self, chunk: worker_pb2.GenerateChunk) -> worker_pb2.GenerateChunk | None:
        """The part of `chunk` the client does not have yet (None: nothing); a 502 when the
        replay parts from the relayed tokens."""
        want = self.relayed.token_ids[self.tokens :]
        overlap = min(len(chunk.token_ids), len(want))
        same = next((i for i in range(overlap) if chunk.token_ids[i] != want[i]), overlap)
        if same < overlap or (chunk.finish_reason and len(want) > overlap):
            raise worker_failed(
                f"the seeded replay of choice {self.index} parted from the tokens already sent "
                f"after {self.tokens + same} of {len(self.relayed.token_ids)}: "
                "the seeded sequence cannot go on on another worker"
            )
        text_overlap = max(0, min(len(chunk.text), self.relayed.text_chars - self.chars))
        self.tokens += len(chunk.token_ids)
        self.chars += len(chunk.text)
        passed = overlap == len(chunk.token_ids) and text_overlap == len(chunk.text)
        if passed and not chunk.finish_reason:
            return None
        rest = worker_pb2.GenerateChunk()
        rest.CopyFrom(chunk)
        del rest.token_ids[:overlap]
        del rest.logprobs[:overlap]
        rest.text = chunk.text[text_overlap:]
        return rest
