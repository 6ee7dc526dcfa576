"""Admission of one HTTP request: validate the body, tokenize its prompts, and build a run and
a worker request per prompt, under the request's one deadline. Nothing is sent yet; a request
that fails here is a 4xx (or a 503 before any worker has joined). It runs in the tokenizer's
threads (router/flow/tokenization.py): the event loop goes on serving meanwhile."""

import math
import uuid
from dataclasses import dataclass

from pdserve.core.kinds import Role, RouteReason
from pdserve.costs.path_prices import RouteDecision
from pdserve.settings import json_logs
from pdserve.settings.router import RouterSettings
from router.flow.request_run import Admitted, RequestRun
from router.flow.route_choice import forced_route
from router.flow.wait_forecast import Ask
from router.flow.worker_request import generate_request
from router.http.api_keys import Caller, KeyRole, request_salt
from router.http.errors import ErrorCode, check_model, invalid_request, worker_unavailable
from router.http.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_request,
)
from router.http.responses import MAX_RESPONSE_ENTRIES, OutputOptions, Prompt, logprob_entries
from router.workers.pool import TAKES_REQUESTS, WorkerPool

TIMEOUT_HEADER = "x-pdserve-timeout"
PRIORITY_HEADER = "x-pdserve-priority"  # the request's admission class, over its body's priority
TRUSTED = Caller(KeyRole.ADMIN)  # a caller of an open router (no API key configured)
# A body of at most this many bytes with one prompt is admitted on the event loop: at most
# ~0.5 ms of it (a 1 KiB chat message, templated and tokenized), and handing it to a tokenizer
# thread costs the router more CPU than admitting it (docs/benchmarking.md).
INLINE_BYTES = 1024


@dataclass(frozen=True)
class HttpAsk:
    """What admission takes from one HTTP request."""

    endpoint: str  # "chat" or "completions"
    schema: type[SamplingFields]
    body: object  # the parsed JSON
    id_prefix: str  # of the request id: "chatcmpl", "cmpl"
    arrival: float  # monotonic seconds
    route: str | None = None  # x-pdserve-route
    timeout: str | None = None  # x-pdserve-timeout: the client's own limit, in seconds
    priority: str | None = None  # x-pdserve-priority: its class in the router's queue
    caller: Caller = TRUSTED  # what its API key may set (router/http/api_keys.py)
    trace: object = None  # the OpenTelemetry context of its span (pdserve/core/tracing.py)


def admits_inline(body: object, size: int | None) -> bool:
    """Whether a body of `size` bytes (None: not known before it was read, as when it came
    chunked) is admitted on the event loop rather than in the tokenizer's threads: at most
    INLINE_BYTES, and not a batch of prompts (each costs ~20 µs, however short)."""
    if size is None or size > INLINE_BYTES or not isinstance(body, dict):
        return False
    prompt = body.get("prompt")
    return not isinstance(prompt, list) or all(isinstance(item, int) for item in prompt)


def admit(settings: RouterSettings, pool: WorkerPool, tokenizer, ask: HttpAsk) -> Admitted:
    """`tokenizer`: router/flow/tokenization.py's PromptTokenizer. The client's timeout is used
    when it is below --request-timeout; its priority header replaces the body's `priority`.
    The priority and the path (the body's `priority`, x-pdserve-priority, x-pdserve-route) are
    an operator's or an admin's to set; a client's are ignored (class 0, the path the router
    chooses). Every worker request carries the cache salt of the caller's key and the body's
    `cache_salt`. A 400 for a response over MAX_RESPONSE_ENTRIES logprob entries."""
    caller = ask.caller
    route_header, priority_header = (ask.route, ask.priority) if caller.steers else (None, None)
    timeout_s = settings.request_timeout_s
    if ask.timeout is not None:
        timeout_s = min(timeout_s, parse_timeout(ask.timeout))
    priority = None if priority_header is None else parse_priority(priority_header)
    parsed = parse_request(ask.schema, ask.body)
    check_model(parsed.model, settings.served_model)
    if not caller.steers:
        priority = 0
    check_sequences(parsed, pool)
    prompts, echo_texts = _prompts(parsed, tokenizer)
    if not pool.max_model_len:
        raise worker_unavailable("no worker has joined the pools yet; retry later")
    request_id = f"{ask.id_prefix}-{parsed.request_id or uuid.uuid4().hex}"
    json_logs.request_id.set(request_id)  # on every line logged for this request
    # The workers' ids stay unique when clients reuse their request_id.
    unique = request_id if parsed.request_id is None else f"{request_id}-{uuid.uuid4().hex[:8]}"
    # Its key's salt and its own (router/http/api_keys.py).
    salt = request_salt(caller, parsed.cache_salt)
    param = "messages" if ask.endpoint == "chat" else "prompt"
    run_ids = [unique] if len(prompts) == 1 else [f"{unique}-{n}" for n in range(len(prompts))]
    worker_requests = [
        generate_request(
            parsed, run_id, prompt_ids, pool.max_model_len, settings.default_max_tokens, param, salt
        )
        for run_id, prompt_ids in zip(run_ids, prompts, strict=True)
    ]
    forced = forced_route(route_header, bool(pool.live((Role.PREFILL,))))
    runs = [
        RequestRun(
            run_id,
            len(prompt_ids),
            ask.arrival,
            timeout_s,
            choices=parsed.choice_count(),
            route_forced=RouteDecision(forced, RouteReason.HEADER) if forced else None,
            trace=ask.trace,
        )
        for run_id, prompt_ids in zip(run_ids, prompts, strict=True)
    ]
    options = output_options(parsed)
    check_logprob_entries(worker_requests, options, ask.endpoint, tokenizer)
    return Admitted(
        request_id,
        runs,
        worker_requests,
        [Prompt(ids, text) for ids, text in zip(prompts, echo_texts, strict=True)],
        options,
        parsed.stream,
        parsed.include_usage_in_stream(),
        returned=parsed.n,
        priority=parsed.priority if priority is None else priority,
    )


def check_logprob_entries(
    worker_requests: list, options: OutputOptions, endpoint: str, tokenizer
) -> None:
    """A 400 for a response that would carry over MAX_RESPONSE_ENTRIES logprob entries."""
    vocab_size = getattr(tokenizer, "vocab_size", 0) or 1 << 20
    entries = sum(
        logprob_entries(
            request.sampling,
            len(request.prompt_token_ids),
            options,
            endpoint == "completions",
            vocab_size,
        )
        for request in worker_requests
    )
    if entries > MAX_RESPONSE_ENTRIES:
        raise invalid_request(
            f"the response would carry up to {entries} logprob entries, more than "
            f"{MAX_RESPONSE_ENTRIES} (choices x (echoed prompt + max_tokens) x "
            "(logprobs + 1)): ask for fewer choices, tokens or logprobs",
            param="logprobs",
            code=ErrorCode.INVALID_VALUE,
        )


def asking(admitted: Admitted, settings: RouterSettings) -> Ask:
    """What the admission gate is told of a request: its size, its class and its limit: its
    prompt must start computing within --max-queue-wait of its arrival, and before its own
    deadline when it set one (x-pdserve-timeout below --request-timeout); no limit without
    either."""
    run = admitted.runs[0]  # every run shares the request's arrival and deadline
    give_up_at = math.inf
    if settings.max_queue_wait_s:
        give_up_at = run.arrival + settings.max_queue_wait_s
    if run.timeout_s < settings.request_timeout_s:
        give_up_at = min(give_up_at, run.arrival + run.timeout_s)
    return Ask(
        prompt_tokens=sum(run.prompt_tokens for run in admitted.runs),
        max_tokens=max(request.sampling.max_tokens for request in admitted.worker_requests),
        priority=admitted.priority,
        give_up_at=give_up_at,
    )


def sequences(admitted: Admitted) -> int:
    """The engine sequences a request runs at once: its prompts times their choices (n, or
    best_of), what its turn in the admission gate weighs."""
    return sum(run.choices for run in admitted.runs)


def check_sequences(parsed: SamplingFields, pool: WorkerPool) -> None:
    """A 400 for a request that no worker, or not the whole cluster, could run at once: more
    choices of one prompt than the largest engine's max_num_seqs (the choices of a prompt run
    on one worker), or more sequences in all (prompts × choices) than the live decode and
    colocated workers' max_num_seqs add up to. No check before any worker has said its size."""
    sizes = [
        w.identity.max_num_seqs for w in pool.live(TAKES_REQUESTS) if w.identity.max_num_seqs > 0
    ]
    if not sizes:
        return
    choices = parsed.choice_count()
    prompts = 1 if isinstance(parsed, ChatCompletionRequest) else len(parsed.prompts())
    param = "best_of" if choices > parsed.n else "n"
    if choices > max(sizes):
        raise invalid_request(
            f"{param} ({choices}) is more choices than a worker runs at once ({max(sizes)}, "
            f"its engine's max_num_seqs)",
            param=param,
            code=ErrorCode.INVALID_VALUE,
        )
    if prompts * choices > sum(sizes):
        raise invalid_request(
            f"{prompts} prompts × {choices} choices are {prompts * choices} sequences, more than "
            f"the cluster runs at once ({sum(sizes)}, its engines' max_num_seqs); send fewer "
            f"prompts or choices per request",
            param=param,
            code=ErrorCode.INVALID_VALUE,
        )


def _prompts(parsed: SamplingFields, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids, and the text echo puts first for it."""
    if isinstance(parsed, ChatCompletionRequest):
        return [tokenizer.chat(parsed)], [chat_echo_text(parsed)]
    prompts = tokenizer.completion_prompts(parsed)
    echo_texts = [
        prompt if isinstance(prompt, str) else tokenizer.detokenize(prompt_ids)
        for prompt, prompt_ids in zip(parsed.prompts(), prompts, strict=True)
    ]
    return prompts, echo_texts


def parse_timeout(header: str) -> float:
    try:
        seconds = float(header)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise invalid_request(
            f"{TIMEOUT_HEADER} must be a number of seconds > 0, not {header!r}",
            param=TIMEOUT_HEADER,
        )
    return seconds


def parse_priority(header: str) -> int:
    try:
        return int(header)
    except ValueError:
        raise invalid_request(
            f"{PRIORITY_HEADER} must be an integer (smaller is served first), not {header!r}",
            param=PRIORITY_HEADER,
        ) from None


def output_options(parsed: SamplingFields) -> OutputOptions:
    echo_only = isinstance(parsed, CompletionRequest) and parsed.echo and parsed.max_tokens == 0
    return OutputOptions(
        logprobs=parsed.output_logprobs(),
        all_top=bool(parsed.logprob_token_ids),
        prompt_logprobs=parsed.prompt_logprobs_asked() is not None,
        echo=parsed.echo,
        echo_only=echo_only,
        as_token_ids=parsed.return_tokens_as_token_ids,
        return_token_ids=parsed.return_token_ids,
        continuous_usage=parsed.stream_options is not None
        and parsed.stream_options.continuous_usage_stats,
    )


def chat_echo_text(parsed: ChatCompletionRequest) -> str:
    """What chat's echo puts first: the last message, when it is the assistant's (vLLM)."""
    last = parsed.messages[-1]
    if not parsed.echo or last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(part.text for part in last.content)
