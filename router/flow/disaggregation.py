"""The disaggregated path: prefill on one worker, decode on another, KV pushed between them.

The prefill worker computes the prompt (max_tokens=1) and its connector pushes each layer's KV
to the decode worker while later layers compute; the decode worker admits the request as
"waiting for KV" under the same transfer id, reserves its blocks and loads the KV, then decodes.
The client's tokens come from the decode leg. If the prefill leg fails, the router cancels the
transfer so the decode worker applies its policy (recompute or fail) at once instead of at the
deadline. If the decode leg never runs (the prefill's first token ended the request, the client
left between the legs, an error), the router cancels the transfer too: the decode worker then
frees the KV that came for it at once, which would otherwise hold its KV inbox, and with it
every other transfer to it, until the KV expired.

Whether a request takes this path is decided in router/flow/route_choice.py.
"""

import asyncio
import json
import logging
from dataclasses import dataclass, field

from pdserve.core.kinds import Transport
from pdserve.protocol import worker_pb2
from pdserve.protocol.transport_choice import choose_transport
from pdserve.settings.router import AFTER_PREFILL
from router.http.errors import ErrorKind, OpenAIError, prefill_lost, worker_failed
from router.workers.data_parallel import on_rank
from router.workers.handle import WorkerHandle

log = logging.getLogger("pdserve.router")


@dataclass
class PrefillOutcome:
    """What the prefill leg reports: its timing and prefix-cache hit, or why it failed."""

    admission: str = AFTER_PREFILL  # when the decode leg starts (see generate_disaggregated)
    chunk: worker_pb2.GenerateChunk | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # WORKER_UNAVAILABLE marks the worker down
    ended_request: bool = False  # its first token ended the request: no decode leg ran
    transfer_cancelled: bool = False  # the decode worker was told the KV will not come
    transport: Transport | str = ""  # what the router chose to carry the KV
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def wait(self, timeout_s: float = 2.0) -> None:
        """The decode leg can end a moment before the prefill leg's last message arrives."""
        try:
            await asyncio.wait_for(self.done.wait(), timeout_s)
        except TimeoutError:
            log.warning(
                "the prefill leg had not reported %.0f s after the decode leg ended", timeout_s
            )


async def generate_disaggregated(
    prefill: WorkerHandle,
    decode: WorkerHandle,
    request: worker_pb2.GenerateRequest,
    kv_timeout_s: float,
    timeout_s: float,
    outcome: PrefillOutcome,
    attempt: int = 0,
    skip_tokens: int = 0,
):
    """Yield the request's chunks; the prefill leg fills `outcome`. With `with-prefill` the
    decode worker is told at once and reserves the KV blocks while the prompt computes, and
    every token comes from it. With `after-prefill` the first token comes from the prefill leg
    and the decode worker is told then, by which time the KV already waits in its receiver (a
    failed prefill has cancelled the transfer, so the decode worker's policy applies at once),
    unless the prefill worker was lost: then `prefill_lost` is raised before the decode worker
    hears of the request, for the router to try another prefill worker (`attempt` 1, 2, ...:
    each attempt is a new transfer, the cancelled one stays cancelled). `skip_tokens`: the
    leading prompt tokens the decode worker likely holds in its prefix cache already (the
    cache-aware policy's estimate): the prefill worker sends none of their whole blocks, and a
    decode worker that turns out to hold fewer computes the prompt itself
    (decode_workers/load_plan.py)."""
    transfer_id = request.request_id if attempt == 0 else f"{request.request_id}-retry{attempt}"
    outcome.transport = pair_transport(prefill, decode)
    decode_request = on_rank(
        decode, _decode_leg(request, transfer_id, prefill, kv_timeout_s, skip_tokens)
    )
    prefill_request = on_rank(
        prefill,
        _prefill_leg(
            request,
            transfer_id,
            decode,
            decode_request.data_parallel_rank,
            outcome.transport,
            skip_tokens,
        ),
    )
    # The prompt's logprobs come from the prefill leg, where the prompt is computed.
    wants_prompt_logprobs = request.sampling.HasField("prompt_logprobs")
    prefill_task = asyncio.create_task(
        _run_prefill(prefill, prefill_request, decode, timeout_s, outcome)
    )
    decode_leg_ran = False
    with decode.in_use():  # its channel stays open while the prefill leg runs
        try:
            if outcome.admission == AFTER_PREFILL:
                await outcome.done.wait()  # bounded: the prefill leg has the request's deadline
                first = outcome.chunk
                if outcome.error_kind == ErrorKind.WORKER_UNAVAILABLE and first is None:
                    raise prefill_lost(outcome.error)
                if (
                    outcome.error is None
                    and first is not None
                    and first.token_ids
                    and continues_from_first_token(request)
                ):
                    # The client's first token is the prefill's; the decode worker goes on from
                    # the prompt and that token, computing only the token's own position.
                    done = (
                        first.finish_reason == "stop"
                        or len(first.token_ids) >= request.sampling.max_tokens
                    )
                    # Not from a token without text yet (the first bytes of a character): vLLM's
                    # detokenizer, started on a prompt ending in it, would put the whole prompt
                    # in the answer's text once the character is complete.
                    if done or first.text:
                        relayed = worker_pb2.GenerateChunk()
                        relayed.CopyFrom(first)
                        relayed.finish_reason = first.finish_reason if done else ""
                        outcome.ended_request = done
                        wants_prompt_logprobs = False  # they came with the prefill's token
                        yield relayed
                        if done:
                            return
                        decode_request.prompt_token_ids.extend(first.token_ids)
                        decode_request.sampling.max_tokens -= len(first.token_ids)
                        decode_request.kv.kv_tokens = len(request.prompt_token_ids)
            decode_leg_ran = True  # from here the decode worker frees the KV itself
            async for chunk in decode.generate(decode_request, timeout=timeout_s):
                if wants_prompt_logprobs:
                    await _add_prompt_logprobs(chunk, outcome)
                    wants_prompt_logprobs = False
                yield chunk
        finally:
            if not prefill_task.done():
                prefill_task.cancel()
            if not decode_leg_ran and not outcome.transfer_cancelled:
                outcome.transfer_cancelled = True
                cancel_transfer_soon(
                    decode,
                    transfer_id,
                    "no decode leg: the prefill's first token ended the request"
                    if outcome.ended_request
                    else "no decode leg: the request ended before it",
                )


def _prefill_leg(
    request: worker_pb2.GenerateRequest,
    transfer_id: str,
    decode: WorkerHandle,
    decode_rank: int,
    transport: Transport,
    skip_tokens: int,
) -> worker_pb2.GenerateRequest:
    """The prefill worker's request: the prompt and one token, its KV sent to `decode`'s
    data-parallel rank `decode_rank` (0 for a worker of one rank)."""
    leg = worker_pb2.GenerateRequest()
    leg.CopyFrom(request)
    leg.request_id = f"{transfer_id}-prefill"
    leg.sampling.max_tokens = 1
    leg.sampling.min_tokens = 0  # its token is used only without min_tokens
    leg.sampling.n = 1  # the decode worker samples the n choices
    leg.sampling.vllm_fields_json = _without_grammar(request.sampling)
    leg.kv.CopyFrom(
        worker_pb2.KvTransfer(
            transfer_id=transfer_id,
            send_to=decode.identity.kv_address,
            peer_tensor_parallel_size=decode.identity.tensor_parallel_size,
            transport=transport,
            skip_tokens=skip_tokens,
            peer_data_parallel_rank=decode_rank,
        )
    )
    return leg


def _decode_leg(
    request: worker_pb2.GenerateRequest,
    transfer_id: str,
    prefill: WorkerHandle,
    kv_timeout_s: float,
    skip_tokens: int,
) -> worker_pb2.GenerateRequest:
    """The decode worker's request: the whole request, its prompt's KV awaited from `prefill`
    (the prompt logprobs come from the prefill leg)."""
    leg = worker_pb2.GenerateRequest()
    leg.CopyFrom(request)
    leg.ClearField("pool_fetch")  # the prefill worker computes the prompt
    leg.kv.CopyFrom(
        worker_pb2.KvTransfer(
            transfer_id=transfer_id,
            receive_timeout_s=kv_timeout_s,
            peer_tensor_parallel_size=prefill.identity.tensor_parallel_size,
            skip_tokens=skip_tokens,
        )
    )
    leg.sampling.ClearField("prompt_logprobs")
    return leg


def pair_transport(prefill: WorkerHandle, decode: WorkerHandle) -> Transport:
    """The KV transport for this pair, from what both workers said in Health."""
    return choose_transport(
        prefill.identity.kv_transport,
        decode.identity.kv_transport,
        same_host=bool(prefill.identity.host_id)
        and prefill.identity.host_id == decode.identity.host_id,
        both_cuda=prefill.identity.device == decode.identity.device == "cuda",
    )


async def _add_prompt_logprobs(chunk: worker_pb2.GenerateChunk, outcome: PrefillOutcome) -> None:
    """The prefill leg's prompt logprobs, on the decode leg's first chunk (a 502 when the
    prefill leg failed: the decode worker had the KV, or recomputed it, but no logprobs)."""
    await outcome.done.wait()  # bounded: the prefill leg has the request's deadline
    if outcome.chunk is None or not outcome.chunk.prompt_logprobs:
        raise worker_failed(
            f"the prompt logprobs were lost with the prefill leg: {outcome.error or 'none sent'}"
        )
    chunk.prompt_logprobs.extend(outcome.chunk.prompt_logprobs)


def _without_grammar(sampling: worker_pb2.SamplingParams) -> str:
    """The prefill leg's vLLM fields: no structured-output grammar (its one token is not the
    client's when there is one, and compiling it there would be wasted)."""
    fields = json.loads(sampling.vllm_fields_json or "{}")
    fields.pop("structured_outputs", None)
    return json.dumps(fields) if fields else ""


# vLLM fields whose effect depends on the tokens sampled before: with them the decode worker
# samples the first token too, so that its state starts from the first output token.
STATEFUL_FIELDS = (
    "structured_outputs",
    "bad_words",
    "repetition_detection",
    "thinking_token_budget",
)


def continues_from_first_token(request: worker_pb2.GenerateRequest) -> bool:
    """Whether the decode worker may go on from the prefill's first token. Not with stop
    strings (one spanning the first and second tokens would go unseen: the first token is then
    prompt to the decode worker), nor with a seed (the decode worker would sample from a later
    position of its random stream), nor with min_tokens (the prefill leg, asked for one token,
    may end the sequence there), nor with presence or frequency penalties (they count output
    tokens only, and the first token would be prompt), nor with n choices (each samples its
    own), nor with STATEFUL_FIELDS (a grammar, say, must see the first token as output): then
    the decode worker samples the first token itself."""
    fields = json.loads(request.sampling.vllm_fields_json or "{}")
    return (
        request.sampling.n <= 1
        and not any(name in fields for name in STATEFUL_FIELDS)
        and not request.sampling.stop
        and not request.sampling.HasField("seed")
        and not request.sampling.min_tokens
        and not request.sampling.presence_penalty
        and not request.sampling.frequency_penalty
    )


async def _run_prefill(
    prefill: WorkerHandle,
    request: worker_pb2.GenerateRequest,
    decode: WorkerHandle,
    timeout_s: float,
    outcome: PrefillOutcome,
) -> None:
    try:
        async for chunk in prefill.generate(request, timeout=timeout_s):
            outcome.chunk = chunk
    except OpenAIError as error:
        outcome.error, outcome.error_kind = error.message, error.kind
        log.warning(
            "prefill of %s failed (%s); cancelling its KV transfer",
            request.kv.transfer_id,
            error.message,
        )
        outcome.transfer_cancelled = True
        cancel_transfer_soon(
            decode, request.kv.transfer_id, f"prefill worker failed: {error.message}"
        )
    finally:
        outcome.done.set()


_cancelling: set[asyncio.Task] = set()  # cancels under way (a task needs a reference)


def cancel_transfer_soon(decode: WorkerHandle, transfer_id: str, reason: str) -> asyncio.Task:
    """Tell the decode worker that a transfer's KV will not be used, from a task of its own:
    the caller may be a closing generator or a cancelled task, whose cancellation must not
    cancel the call. Best effort (WorkerHandle.cancel_transfer logs a failure); the decode
    worker is held meanwhile, so the pool does not close its channel under the call."""

    async def cancel() -> None:
        try:
            with decode.in_use():
                await decode.cancel_transfer(transfer_id, reason)
        except Exception as error:  # not a gRPC error: its channel was closed, say
            log.warning("could not cancel transfer %s: %s", transfer_id, error)

    task = asyncio.create_task(cancel())
    _cancelling.add(task)
    task.add_done_callback(_cancelling.discard)
    return task
