"""The router's request steps after admission: `start`'s retry loop over decode workers
(router/flow/retries.py, its choices from router/flow/route_choice.py), and `collect`/`finish`
of a local request. A real WorkerPool with a round-robin policy holds fake workers
(tests/fakes.py) whose `generate` either fails before its first chunk or streams canned chunks;
each test drives the coroutines with asyncio.run. No engine, no network."""

import asyncio
import threading
import time

import pytest

from pdserve.core.kinds import RoutePath, RouteReason
from pdserve.costs.path_prices import RouteDecision
from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from router.flow.accounting import timing_breakdown
from router.flow.request_run import Admitted, RequestRun
from router.flow.retries import MAX_ATTEMPTS
from router.flow.route_choice import ROUTE_HEADER
from router.http.errors import OpenAIError, invalid_request, worker_unavailable
from router.http.responses import CompletionShape, OutputOptions, Prompt
from router.workers.choice import WorkerChoice
from router.workers.kv_pool_contents import block_keys
from router.workers.policies import PEER_FETCH_SAVES, POOL_LOAD_SAVES, CacheAware, RoundRobin
from router.workers.pool import WorkerPool
from tests.fakes import FakeWorker, RouterParts, answering, router_over, unavailable

PROMPT = [11, 12, 13, 14, 15]


def new_request(request_id: str = "cmpl-1") -> tuple[RequestRun, worker_pb2.GenerateRequest]:
    run = RequestRun(request_id, len(PROMPT), time.monotonic())
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=worker_pb2.SamplingParams(max_tokens=3),
    )
    return run, request


def start(flow: RouterParts, run: RequestRun, request: worker_pb2.GenerateRequest):
    """Run `start` and close the stream it opened; returns (first chunk, headers)."""

    async def go():
        started = await flow.starter.start(run, request)
        first, chunks, headers = started.first, started.chunks, started.headers
        await chunks.aclose()
        return first, headers

    return asyncio.run(go())


def start_error(flow: RouterParts, run: RequestRun, request) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        asyncio.run(flow.starter.start(run, request))
    return caught.value


def test_an_unavailable_decode_worker_is_marked_down_and_another_one_answers():
    gone, alive = unavailable("decode-a"), answering("decode-b")
    flow = router_over(gone, alive)
    run, request = new_request()
    first, headers = start(flow, run, request)
    assert flow.pool.down == {gone.address}
    assert first.text == "Hello" and list(first.token_ids) == [1, 2]
    assert headers == {
        "x-request-id": "cmpl-1",
        "x-pdserve-worker": "decode-b",
        ROUTE_HEADER: RoutePath.LOCAL,
    }
    assert run.decode_worker is alive
    assert [r.request_id for r in gone.requests] == ["cmpl-1"]
    assert [r.request_id for r in alive.requests] == ["cmpl-1"]


def test_the_request_fails_with_a_503_after_max_attempts_unavailable_workers():
    workers = [unavailable(f"decode-{i}") for i in range(MAX_ATTEMPTS + 1)]
    flow = router_over(*workers)
    run, request = new_request()
    error = start_error(flow, run, request)
    assert (error.status, error.kind) == (503, "worker_unavailable")
    assert sum(len(worker.requests) for worker in workers) == MAX_ATTEMPTS
    assert len(flow.pool.down) == MAX_ATTEMPTS
    assert [len(worker.requests) for worker in workers].count(0) == 1


def test_a_worker_error_other_than_unavailable_is_raised_at_once():
    refusing = FakeWorker("decode-a", error=invalid_request("bad stop string", param="stop"))
    alive = answering("decode-b")
    flow = router_over(refusing, alive)
    run, request = new_request()
    error = start_error(flow, run, request)
    assert (error.status, error.kind) == (400, "invalid_request")
    assert alive.requests == []
    assert flow.pool.down == set()


def test_with_no_decode_worker_at_all_the_request_is_a_503_after_the_worker_wait():
    prefill = answering("prefill-a", role="prefill")
    flow = router_over(prefill, settings=RouterSettings(model="m", worker_wait_s=0.3))
    run, request = new_request()
    started = time.monotonic()
    error = start_error(flow, run, request)
    assert (error.status, error.kind) == (503, "worker_unavailable")
    assert 0.3 <= time.monotonic() - started < 5
    assert prefill.requests == []


def test_a_decode_worker_back_within_the_worker_wait_gets_the_request():
    """A worker whose registry record expired on one late heartbeat is back a heartbeat later:
    a request arriving in that gap waits for it instead of failing."""
    blinked = answering("decode-a")
    flow = router_over(settings=RouterSettings(model="m", worker_wait_s=10))
    run, request = new_request()

    async def go():
        starting = asyncio.create_task(flow.starter.start(run, request))
        await asyncio.sleep(0.3)
        assert not starting.done()  # it waits, no 503
        flow.pool.workers.append(blinked)
        started = await asyncio.wait_for(starting, 5)
        await started.chunks.aclose()
        return started.headers

    assert asyncio.run(go())["x-pdserve-worker"] == "decode-a"
    assert [r.request_id for r in blinked.requests] == ["cmpl-1"]


def test_prefill_workers_never_take_the_decode_leg_of_a_local_request():
    prefills = [answering("prefill-a", role="prefill"), answering("prefill-b", role="prefill")]
    decode, colocated = answering("decode-a"), answering("colocated-a", role="colocated")
    flow = router_over(prefills[0], decode, prefills[1], colocated)
    chosen = []
    for i in range(4):
        run, request = new_request(f"cmpl-{i}")
        chosen.append(start(flow, run, request)[1]["x-pdserve-worker"])
    assert set(chosen) == {"decode-a", "colocated-a"}
    assert all(worker.requests == [] for worker in prefills)


def test_collect_returns_the_whole_text_finish_reason_and_usage_and_counts_the_request():
    flow = router_over(answering("decode-a"))
    run, request = new_request()

    body = collect(flow, run, request)
    [choice] = body["choices"]
    assert choice["text"] == "Hello world"
    assert choice["finish_reason"] == "length"
    assert body["model"] == "m"
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), 3)
    assert usage["total_tokens"] == len(PROMPT) + 3
    registry = flow.metrics.registry
    labels = {"endpoint": "completions", "status": "200"}
    assert registry.get_sample_value("pdserve_requests_total", labels) == 1.0
    assert registry.get_sample_value("pdserve_route_total", {"path": RoutePath.LOCAL}) == 1.0
    assert registry.get_sample_value("pdserve_generation_tokens_total") == 3.0
    assert registry.get_sample_value("pdserve_prompt_tokens_total") == len(PROMPT)


def test_a_worker_ending_a_request_with_abort_is_a_502_from_collect():
    aborting = FakeWorker(
        "decode-a",
        chunks=[
            worker_pb2.GenerateChunk(token_ids=[1], text="Hi"),
            worker_pb2.GenerateChunk(token_ids=[], text="", finish_reason="abort"),
        ],
    )
    flow = router_over(aborting)
    run, request = new_request()

    with pytest.raises(OpenAIError) as caught:
        collect(flow, run, request)
    assert (caught.value.status, caught.value.kind) == (502, "worker_error")
    labels = {"endpoint": "completions", "status": "200"}
    assert flow.metrics.registry.get_sample_value("pdserve_requests_total", labels) is None


def collect(flow: RouterParts, run: RequestRun, request) -> dict:
    """Start the one-prompt request and collect its whole response."""
    admitted = Admitted(
        run.request_id,
        [run],
        [request],
        [Prompt(list(request.prompt_token_ids))],
        OutputOptions(),
        stream=False,
        include_usage=False,
    )

    async def go():
        started = await flow.starter.start_all(admitted)
        shape = CompletionShape(run.request_id, "m")
        return await flow.relay.collect(admitted, started, shape, "completions")

    return asyncio.run(go())


def test_a_decode_worker_lost_mid_stream_hands_the_rest_to_another_one():
    dying = FakeWorker(
        "decode-a",
        chunks=[
            worker_pb2.GenerateChunk(token_ids=[1], text="Hello"),
            worker_pb2.GenerateChunk(token_ids=[2], text=" big"),
        ],
        error=worker_unavailable("worker decode-a is unavailable: Socket closed"),
    )
    rest = FakeWorker(
        "decode-b",
        chunks=[
            worker_pb2.GenerateChunk(token_ids=[3], text=" world"),
            worker_pb2.GenerateChunk(token_ids=[4], text="!", finish_reason="length"),
        ],
    )
    flow = router_over(dying, rest)
    run, request = new_request()
    request.sampling.max_tokens = 4
    body = collect(flow, run, request)
    assert body["choices"][0]["text"] == "Hello big world!"  # nothing twice, nothing missing
    assert body["usage"]["completion_tokens"] == 4
    [continuation] = rest.requests
    assert list(continuation.prompt_token_ids) == PROMPT + [1, 2]
    assert continuation.sampling.max_tokens == 2
    assert continuation.request_id == "cmpl-1-m1"
    assert flow.pool.down == {dying.address}
    assert flow.metrics.registry.get_sample_value("pdserve_migrations_total") == 1.0
    assert flow.metrics.registry.get_sample_value("pdserve_migration_gap_seconds_count") == 1.0


def test_with_no_decode_worker_left_a_lost_stream_ends_in_a_503_after_the_worker_wait():
    dying = FakeWorker(
        "decode-a",
        chunks=[worker_pb2.GenerateChunk(token_ids=[1], text="Hello")],
        error=worker_unavailable("worker decode-a is unavailable"),
    )
    flow = router_over(dying, settings=RouterSettings(model="m", worker_wait_s=0.3))
    run, request = new_request()
    started = time.monotonic()
    with pytest.raises(OpenAIError) as caught:
        collect(flow, run, request)
    assert (caught.value.status, caught.value.kind) == (503, "worker_unavailable")
    assert 0.3 <= time.monotonic() - started < 5


def test_a_lost_stream_waits_for_a_decode_worker_and_continues_on_it():
    dying = FakeWorker(
        "decode-a",
        chunks=[worker_pb2.GenerateChunk(token_ids=[1], text="Hello")],
        error=worker_unavailable("worker decode-a is unavailable"),
    )
    back = answering("decode-b")
    flow = router_over(dying, settings=RouterSettings(model="m", worker_wait_s=10))
    run, request = new_request()

    joining = threading.Timer(0.3, flow.pool.workers.append, [back])  # while it waits
    joining.start()
    body = collect(flow, run, request)
    joining.join()
    assert body["choices"][0]["text"] == "Hello" + "Hello world"
    [continuation] = back.requests
    assert list(continuation.prompt_token_ids) == PROMPT + [1]


def test_every_leg_and_retry_shares_the_one_deadline_set_at_arrival():
    gone, alive = unavailable("decode-a"), answering("decode-b")
    flow = router_over(gone, alive)
    run, request = new_request()
    run.timeout_s = 30.0
    run.arrival -= 12.0  # it has waited 12 s already
    start(flow, run, request)
    assert 17.0 < gone.timeouts[0] <= 18.0  # not the whole 30 s again
    assert 17.0 < alive.timeouts[0] <= gone.timeouts[0]  # the retry: what is left
    assert 17.0 < run.time_left() < 18.0
    run.arrival -= 20.0
    with pytest.raises(OpenAIError) as caught:
        run.time_left()
    assert (caught.value.status, caught.value.kind) == (504, "timeout")


@pytest.mark.parametrize("header", ["0", "-3", "soon", "nan", "inf"])
def test_a_bad_client_timeout_is_a_400(header):
    from router.flow.admission import parse_timeout

    with pytest.raises(OpenAIError) as caught:
        parse_timeout(header)
    assert caught.value.status == 400 and "x-pdserve-timeout" in caught.value.message


def test_a_client_timeout_is_read_in_seconds():
    from router.flow.admission import parse_timeout

    assert parse_timeout("2.5") == 2.5


def first_token(name: str) -> FakeWorker:
    """A prefill worker: its leg gives the prompt's first token."""
    return FakeWorker(name, "prefill", chunks=[worker_pb2.GenerateChunk(token_ids=[1], text="Hi")])


def test_a_prefill_worker_lost_before_its_kv_hands_the_prompt_to_another_one():
    lost, spare, decode = (
        unavailable("prefill-a", "prefill"),
        first_token("prefill-b"),
        answering("decode-a"),
    )
    flow = router_over(lost, spare, decode)
    run, request = new_request()
    run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)

    async def whole_stream():
        started = await flow.starter.start(run, request)
        first, chunks, headers = started.first, started.chunks, started.headers
        return [first] + [chunk async for chunk in chunks], headers

    chunks, headers = asyncio.run(whole_stream())
    assert flow.pool.down == {lost.address}
    assert headers["x-pdserve-prefill-worker"] == "prefill-b"
    assert [c.text for c in chunks] == ["Hi", "Hello", " world"]
    # the lost attempt's transfer, cancelled on the decode worker
    assert [transfer for transfer, _ in decode.cancelled] == ["cmpl-1"]
    assert [r.kv.transfer_id for r in spare.requests] == ["cmpl-1-retry1"]
    # The decode worker heard of the request once, for the second attempt's KV.
    assert [r.kv.transfer_id for r in decode.requests] == ["cmpl-1-retry1"]
    metric = flow.metrics.registry.get_sample_value
    assert metric("pdserve_prefill_lost_total", {"next": "another_prefill"}) == 1
    assert run.route == RoutePath.DISAGGREGATED


def test_with_no_prefill_worker_left_the_prompt_takes_the_local_path():
    lost, decode = unavailable("prefill-a", "prefill"), answering("decode-a")
    flow = router_over(lost, decode)
    run, request = new_request()
    run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)
    first, headers = start(flow, run, request)
    assert first.text == "Hello" and headers[ROUTE_HEADER] == RoutePath.LOCAL
    assert [r.HasField("kv") for r in decode.requests] == [False]  # it prefills the prompt itself
    metric = flow.metrics.registry.get_sample_value
    assert metric("pdserve_prefill_lost_total", {"next": "local"}) == 1


def test_only_a_prefill_worker_whose_kv_the_decode_worker_can_take_is_paired():
    other_dtype, same = first_token("prefill-bf16"), first_token("prefill-f32")
    other_dtype.identity.kv_compatibility = "smollm2-bfloat16"
    decode = answering("decode-a")
    flow = router_over(other_dtype, same, decode)
    for request_id in ("cmpl-1", "cmpl-2"):
        run, request = new_request(request_id)
        run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)
        _, headers = start(flow, run, request)
        assert headers["x-pdserve-prefill-worker"] == "prefill-f32"
    assert other_dtype.requests == []


def test_with_no_compatible_prefill_worker_the_request_goes_local_and_says_why(caplog):
    other_dtype, decode = first_token("prefill-bf16"), answering("decode-a")
    other_dtype.identity.kv_compatibility = "smollm2-bfloat16"
    flow = router_over(other_dtype, decode)
    run, request = new_request()
    run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)
    first, headers = start(flow, run, request)
    assert headers[ROUTE_HEADER] == RoutePath.LOCAL and "x-pdserve-prefill-worker" not in headers
    assert first.text == "Hello" and other_dtype.requests == []
    metric = flow.metrics.registry.get_sample_value
    assert metric("pdserve_kv_fallbacks_total", {"policy": "no_prefill"}) == 1
    assert "KV is compatible with worker decode-a's" in caplog.text


def test_the_decode_worker_is_held_while_the_prefill_leg_runs():
    """So that the pool does not close its channel should it leave the pools meanwhile."""
    release = asyncio.Event()

    class SlowPrefill(FakeWorker):
        async def generate(self, request, timeout):
            await release.wait()
            yield worker_pb2.GenerateChunk(token_ids=[1], text="Hi")

    prefill, decode = SlowPrefill("prefill-a", "prefill"), answering("decode-a")
    flow = router_over(prefill, decode)
    run, request = new_request()
    run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)

    async def go():
        starting = asyncio.create_task(flow.starter.start(run, request))
        await asyncio.sleep(0.05)
        held_during_prefill = decode.users
        release.set()
        started = await starting
        chunks = started.chunks
        await chunks.aclose()
        return held_during_prefill

    assert asyncio.run(go()) == 1
    assert decode.users == 0


def test_a_closed_worker_client_is_unavailable_not_an_internal_error():
    from router.workers.client import WorkerClient

    async def go():
        client = WorkerClient("127.0.0.1:1")
        await client.close()
        with pytest.raises(OpenAIError) as caught:
            await anext(client.generate(worker_pb2.GenerateRequest(request_id="r"), timeout=1))
        return caught.value

    error = asyncio.run(go())
    assert (error.status, error.kind) == (503, "worker_unavailable")


def test_a_request_left_on_its_prefill_worker_runs_there_whole_and_moves_no_kv():
    prefill, decode = answering("prefill-a", role="prefill"), answering("decode-a")
    decode.load.reported(worker_pb2.StatsReply(running_requests=40))  # a full decode worker
    flow = router_over(prefill, decode)
    run, request = new_request()
    first, headers = start(flow, run, request)
    assert (
        headers[ROUTE_HEADER] == RoutePath.STAY_ON_PREFILL
        and headers["x-pdserve-worker"] == "prefill-a"
    )
    assert first.text == "Hello" and decode.requests == []
    (sent,) = prefill.requests
    assert not sent.HasField("kv") and sent.sampling.max_tokens == 3  # the whole request
    assert run.decision.reason == "estimate" and run.decision.route == RoutePath.STAY_ON_PREFILL
    metric = flow.metrics.registry.get_sample_value
    assert metric(
        "pdserve_route_decisions_total", {"path": RoutePath.STAY_ON_PREFILL, "reason": "estimate"}
    )
    assert timing_breakdown(run)["decision"]["costs"][RoutePath.STAY_ON_PREFILL]["total_s"] > 0


def test_the_length_policy_keeps_short_prompts_local_without_asking_a_prefill_worker():
    prefill, decode = answering("prefill-a", role="prefill"), answering("decode-a")
    flow = router_over(prefill, decode, settings=RouterSettings(model="m", route_policy="length"))
    run, request = new_request()
    _, headers = start(flow, run, request)
    assert headers[ROUTE_HEADER] == RoutePath.LOCAL and prefill.requests == []
    assert run.decision.reason == "below_floor"


def disaggregated(
    flow: RouterParts,
    prompt: list[int],
    request_id: str,
    prompt_logprobs: bool = False,
    forced: bool = True,
) -> RequestRun:
    """One request sent on the disaggregated path (forced; or, not `forced`, on the path the
    router's estimate names), its stream read to its end."""
    run = RequestRun(request_id, len(prompt), time.monotonic())
    if forced:
        run.route_forced = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)
    request = worker_pb2.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=worker_pb2.SamplingParams(max_tokens=3),
    )
    if prompt_logprobs:
        request.sampling.prompt_logprobs = 1

    async def whole_stream():
        started = await flow.starter.start(run, request)
        return [chunk async for chunk in started.chunks]

    asyncio.run(whole_stream())
    return run


def test_the_prefill_leg_skips_what_the_decode_worker_holds_until_it_lacks_it():
    """Cache-aware: the next turn's prompt extends the last one, which the decode worker
    received, so both legs name its whole chunks as held; once the decode worker says it did not
    hold them (it computed the prompt), the router stops assuming it does."""
    prefill, decode = first_token("prefill-a"), answering("decode-a")
    flow = router_over(prefill, decode, policy=CacheAware())
    history = list(range(1000, 1300))
    disaggregated(flow, history, "turn-1")
    run = disaggregated(flow, history + list(range(100)), "turn-2")
    skipped = [(r.kv.transfer_id, r.kv.skip_tokens) for r in prefill.requests + decode.requests]
    assert skipped == [("turn-1", 0), ("turn-2", 256)] * 2  # 300 held: 4 chunks of 64
    not_held = worker_pb2.KvTransferStats(failed=True, failure="not_held")
    run.last_chunk = worker_pb2.GenerateChunk(token_ids=[3], kv=not_held)
    flow.accounting.finish(run)
    assert (
        flow.metrics.registry.get_sample_value(
            "pdserve_kv_transfer_failures_total", {"reason": "not_held"}
        )
        == 1
    )
    disaggregated(flow, history + list(range(200)), "turn-3")
    assert decode.requests[-1].kv.skip_tokens == prefill.requests[-1].kv.skip_tokens == 0


def test_a_retry_after_a_lost_prefill_worker_skips_what_the_first_attempt_did():
    """The first attempt counted the prompt as sent to the decode worker; its retry still names
    only what the decode worker held before the request."""
    lost, spare, decode = (
        unavailable("prefill-a", "prefill"),
        first_token("prefill-b"),
        answering("decode-a"),
    )
    gone = first_token("prefill-c")  # computed the turn before, then left
    flow = router_over(gone, decode, policy=CacheAware())
    history = list(range(1000, 1300))
    disaggregated(flow, history, "turn-1")
    flow.pool.workers = [lost, spare, decode]
    disaggregated(flow, history + list(range(100)), "turn-2")
    assert [r.kv.skip_tokens for r in lost.requests] == [256]
    assert [r.kv.skip_tokens for r in spare.requests] == [256]
    assert [r.kv.skip_tokens for r in decode.requests] == [0, 256]


def pool_holds(pool: WorkerPool, worker, prompt: list[int], blocks: int) -> None:
    """`worker`'s host KV pool's store reported holding the prompt's first `blocks` blocks of
    128 tokens (router/workers/kv_pool_contents.py's copy of it)."""
    none_hash = b"n" * 32
    held = list(block_keys(prompt, 128, none_hash))[:blocks]
    pool.pool_contents.update(
        worker,
        worker_pb2.KvPoolContents(
            store_id="s", sequence=2, reset=True, added=held, block_size=128, none_hash=none_hash
        ),
    )


def test_a_prefill_worker_is_priced_as_loading_what_its_host_pool_holds():
    """Two prefill workers sharing a host KV pool whose store reported it holds a prompt's
    first two blocks: each one's price counts most of them as loaded (router/workers/policies.py's
    reusable_tokens, whatever the policy), on top of its own cache; a worker of another host's
    pool would fetch them first (counted at what a fetch saves, and told where to fetch them
    from), and a decode worker (in no pool) has its own cache only."""
    computed, mate, stranger, decode = (
        first_token("prefill-a"),
        first_token("prefill-b"),
        first_token("prefill-c"),
        answering("decode-a"),
    )
    for worker in (computed, mate, stranger):
        worker.identity.kv_pool, worker.identity.host_id = "@pool", "host-1"
    stranger.identity.host_id = "host-2"
    pool = WorkerPool([])
    pool.workers = [computed, mate, stranger, decode]
    choice = WorkerChoice(pool, CacheAware())
    prompt = list(range(1000, 1300))
    pool_holds(pool, computed, prompt, blocks=2)
    choice.policy.computes(computed, prompt)
    view = choice.prompt_view(prompt)
    own = view.cached_on(computed)
    assert own == 256 and choice.reusable_tokens(computed, view) == own
    assert choice.reusable_tokens(mate, view) == int(POOL_LOAD_SAVES * 256)
    assert choice.reusable_tokens(stranger, view) == int(PEER_FETCH_SAVES * 256)
    assert choice.reusable_tokens(decode, view) == 0
    round_robin = WorkerChoice(pool, RoundRobin())
    no_index = round_robin.prompt_view(prompt)
    assert round_robin.reusable_tokens(computed, no_index) == int(POOL_LOAD_SAVES * 256)
    # where each would fetch from: only the other host's worker, from a worker of this pool
    fetch = choice.pool_fetch(stranger, view)
    assert fetch.source in (computed.address, mate.address) and fetch.tokens == 256
    assert choice.pool_fetch(mate, view) is None and choice.pool_fetch(decode, view) is None
    # ... and not when its fetches were measured slower than computing the tokens
    stranger.load.report = worker_pb2.StatsReply(
        prefill_seconds_per_token=1e-3,
        kv_pool_load_seconds_per_token=1e-4,
        kv_pool_fetch_seconds_per_token=2e-3,
    )
    assert choice.pool_fetch(stranger, view) is None
    assert choice.reusable_tokens(stranger, view) == 0
    # ... nor from a worker whose KV its engine could not use
    stranger.load.report = None
    computed.identity.kv_compatibility = mate.identity.kv_compatibility = "another model"
    assert choice.pool_fetch(stranger, view) is None
    # ... nor from a pool of another tensor-parallel size (its blocks hold a part per rank)
    computed.identity.kv_compatibility = mate.identity.kv_compatibility = (
        stranger.identity.kv_compatibility
    )
    computed.identity.tensor_parallel_size = mate.identity.tensor_parallel_size = 2
    assert choice.pool_fetch(stranger, view) is None
    assert choice.reusable_tokens(stranger, view) == 0
    computed.identity.tensor_parallel_size = mate.identity.tensor_parallel_size = 1
    # ... nor what its own prefix cache likely holds (it computed the prompt since)
    assert choice.pool_fetch(stranger, view) is not None
    choice.policy.computes(stranger, prompt)
    assert choice.pool_fetch(stranger, choice.prompt_view(prompt)) is None


def test_a_decode_worker_whose_pool_holds_the_prompt_computes_it_itself_loading_from_there():
    """The estimate prices the local path with what the decode worker's host KV pool holds: a
    long prompt whose history the pool holds is computed on the decode worker (it loads the
    history and computes the rest; no KV moves), where a decode worker without a pool, or
    whose pool lacks it, has it prefilled on the prefill worker. A decode worker whose pool
    lacks what another host's pool holds is told to fetch it for the prompt it computes."""
    prefill, decode = first_token("prefill-a"), answering("decode-a")
    # eight requests decoding there (a prompt computed there stalls them), a load and a fetch
    # each 1% of compute
    decode.load.report = worker_pb2.StatsReply(
        running_requests=8,
        prefill_seconds_per_token=1e-3,
        kv_pool_load_seconds_per_token=1e-5,
        kv_pool_fetch_seconds_per_token=1e-5,
    )
    flow = router_over(prefill, decode)
    pool = flow.pool
    prompt = list(range(1000, 2300))
    assert disaggregated(flow, prompt, "no-pool", forced=False).route == RoutePath.DISAGGREGATED
    decode.identity.kv_pool, decode.identity.host_id = "@pool", "host-1"
    assert disaggregated(flow, prompt, "lacks", forced=False).route == RoutePath.DISAGGREGATED
    pool_holds(pool, decode, prompt, blocks=10)
    run = disaggregated(flow, prompt, "holds", forced=False)
    assert run.route == RoutePath.LOCAL and len(prefill.requests) == 2
    assert not decode.requests[-1].HasField("kv")
    # another host's pool holds it (its prefill worker is busy), the decode worker's lacks it:
    # fetched, then loaded
    elsewhere = first_token("prefill-b")
    elsewhere.identity.kv_pool, elsewhere.identity.host_id = "@pool", "host-2"
    elsewhere.load.report = worker_pb2.StatsReply(outstanding_prefill_tokens=100_000)
    pool.workers.append(elsewhere)
    pool_holds(pool, elsewhere, prompt, blocks=10)
    pool_holds(pool, decode, prompt, blocks=0)
    assert disaggregated(flow, prompt, "fetch", forced=False).route == RoutePath.LOCAL
    assert decode.requests[-1].pool_fetch.tokens == 1280


def test_the_worker_computing_a_prompt_is_told_to_fetch_what_another_hosts_pool_holds():
    """The prefill leg goes to a worker whose host KV pool lacks the prompt's first two blocks,
    which another host's pool holds: its request names that pool's worker and the tokens to
    fetch (pdserve/worker/pool_peers.py); the decode leg, which computes nothing, names none."""
    fetching, source, decode = first_token("prefill-a"), first_token("prefill-b"), answering("d")
    fetching.identity.kv_pool, fetching.identity.host_id = "@pool", "host-1"
    source.identity.kv_pool, source.identity.host_id = "@pool", "host-2"
    flow = router_over(fetching, source, decode)
    prompt = list(range(1000, 1300))
    pool_holds(flow.pool, source, prompt, blocks=2)
    disaggregated(flow, prompt, "turn-1")
    (leg,) = fetching.requests
    assert leg.pool_fetch == worker_pb2.PoolFetch(source=source.address, tokens=256)
    assert not decode.requests[0].HasField("pool_fetch")
    # the source computes the next (round-robin): its own pool holds the most, nothing to fetch
    disaggregated(flow, prompt, "turn-2")
    assert [r.HasField("pool_fetch") for r in source.requests] == [False]
    # a request for its prompt's logprobs reads no cached KV: nothing to fetch for it either
    disaggregated(flow, prompt, "turn-3", prompt_logprobs=True)
    assert [r.HasField("pool_fetch") for r in fetching.requests] == [True, False]
