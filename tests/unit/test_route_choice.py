"""Route choice (router/flow/route_choice.py): `choose`, one attempt's whole choice made from a
run's PromptView with no event loop; the path estimate (pdserve/costs/path_prices.py) as the
router feeds it, over tests/fakes.py's workers (their load reports set by hand); and the figures
the workers learn (pdserve/worker/step_costs.py)."""

import pytest

from pdserve.core.kinds import Role, RoutePath, RouteReason
from pdserve.costs.path_prices import RATE_WINDOW_S, RouteDecision, WorkerState, estimate
from pdserve.costs.step_costs import DEFAULT_COSTS
from pdserve.protocol import worker_pb2
from pdserve.settings.router import RouterSettings
from pdserve.worker.step_costs import DEFAULT_SEQUENCE_SHARE, MIN_PREFILL_TOKENS, StepCostLearner
from router.flow.route_choice import Tried, choose, cluster_costs, worker_state
from router.http.errors import OpenAIError
from router.workers.choice import WorkerChoice
from router.workers.load import WorkerLoad
from router.workers.policies import CacheAware, RoundRobin
from router.workers.pool import WorkerPool
from tests.fakes import FakeWorker

FLOOR = 256
LONG, SHORT = 1500, 100


def fake_worker(sent_per_second: tuple[int, int] = (0, 0), **report) -> FakeWorker:
    """A worker with its last Stats, and what the router sent it over the rate window
    (requests per second, prompt tokens each)."""
    load = WorkerLoad()
    requests, tokens = sent_per_second
    for _ in range(round(requests * RATE_WINDOW_S)):
        load.sent(tokens)
    if report:
        load.reported(worker_pb2.StatsReply(**report))  # those sends are in the report now
    else:
        load.requests_since = load.prompt_tokens_since = 0
    worker = FakeWorker("w")
    worker.load = load
    return worker


def state(**report) -> WorkerState:
    return worker_state(fake_worker(**report), DEFAULT_COSTS)


def decide(prompt_tokens: int, decode: WorkerState, prefill: WorkerState, max_tokens=64):
    return estimate(prompt_tokens, max_tokens, decode, prefill, FLOOR)


def test_a_backed_up_prefill_pool_sends_a_long_prompt_to_its_decode_worker():
    decision = decide(LONG, state(), state(outstanding_prefill_tokens=20_000, running_requests=5))
    assert decision.route == RoutePath.LOCAL and decision.reason == "estimate"
    costs = {cost.route: cost for cost in decision.costs}
    assert (
        costs[RoutePath.DISAGGREGATED].ttft_s > costs[RoutePath.LOCAL].ttft_s + 50
    )  # 20,000 tokens queued first


def test_a_full_decode_worker_leaves_the_request_on_an_idle_prefill_worker():
    decode = state(running_requests=40)
    decision = estimate(SHORT, 64, decode, state(), FLOOR, decode_full=True)
    assert decision.route == RoutePath.STAY_ON_PREFILL


def test_a_decode_worker_with_room_keeps_the_prefill_worker_free_of_decoding():
    decode = state(running_requests=40)
    decision = decide(SHORT, decode, state())
    assert decision.route == RoutePath.LOCAL
    assert RoutePath.STAY_ON_PREFILL not in {cost.route for cost in decision.costs}


def test_a_worker_is_full_once_it_runs_what_its_engine_takes():
    load = WorkerLoad(worker_pb2.StatsReply(running_requests=7))
    assert not load.full(max_num_seqs=8)
    load.sent(10)
    assert load.full(max_num_seqs=8)


def test_a_long_prompt_goes_where_its_prefill_stalls_nobody():
    """The decode worker decodes 6 requests and is sent a short prompt a second; the prefill
    worker computes long prompts most of its time: prefilling there stalls no decoding request,
    and decoding there would crawl between its prefills."""
    decode = state(running_requests=6, sent_per_second=(1, SHORT))
    prefill = state(sent_per_second=(0.2, LONG))
    decision = decide(LONG, decode, prefill)
    assert decision.route == RoutePath.DISAGGREGATED, decision.view()


def test_a_short_prompt_is_never_disaggregated_and_an_idle_cluster_keeps_it_local():
    decision = decide(SHORT, state(), state())
    assert decision.route == RoutePath.LOCAL  # ties go to the decode worker, which moves no KV
    assert RoutePath.DISAGGREGATED not in {cost.route for cost in decision.costs}


def test_the_costs_come_back_cheapest_first_with_their_parts():
    decision = decide(LONG, state(running_requests=3), state())
    totals = [cost.total_s for cost in decision.costs]
    assert totals == sorted(totals) and decision.route == decision.costs[0].route
    view = decision.view()["costs"]
    assert set(view[RoutePath.LOCAL]) == {"ttft_s", "decode_s", "others_s", "total_s"}


def test_expected_output_is_bounded_so_a_huge_max_tokens_does_not_drown_the_prompt():
    small, huge = decide(LONG, state(), state(), 256), decide(LONG, state(), state(), 100_000)
    assert [c.total_s for c in small.costs] == [c.total_s for c in huge.costs]


def test_what_the_router_sent_since_the_last_report_counts_as_queued():
    worker = fake_worker(outstanding_prefill_tokens=100, running_requests=3, prefilling_requests=1)
    worker.load.sent(400)
    seen = worker_state(worker, DEFAULT_COSTS)
    assert seen.queued_tokens == 500 and seen.decoding == 2


def test_a_worker_that_learned_nothing_yet_is_priced_like_the_cluster():
    learned = fake_worker(
        prefill_seconds_per_token=0.001,
        decode_step_base_seconds=0.02,
        decode_step_seconds_per_sequence=0.002,
    )
    fresh = fake_worker(running_requests=1)
    cluster = cluster_costs([learned, fresh])
    assert cluster.prefill_s_per_token == 0.001 and cluster.decode_base_s == 0.02
    assert worker_state(fresh, cluster).costs == worker_state(learned, cluster).costs
    assert cluster_costs([fresh]) == DEFAULT_COSTS


def test_step_costs_fit_a_decode_step_from_its_batch():
    costs = StepCostLearner()
    for _ in range(50):
        for batch in (1, 4, 8):
            costs.decode_step(batch, 0.03 + 0.005 * batch)
    fit = costs.costs()
    assert fit.decode_base_s == pytest.approx(0.03, rel=1e-6)
    assert fit.decode_s_per_sequence == pytest.approx(0.005, rel=1e-6)


def test_one_batch_size_alone_gives_a_share_of_a_step_per_sequence():
    costs = StepCostLearner()
    for _ in range(10):
        costs.decode_step(2, 0.05)
    fit = costs.costs()
    assert fit.decode_s_per_sequence == pytest.approx(DEFAULT_SEQUENCE_SHARE * 0.05)
    assert fit.decode_base_s + 2 * fit.decode_s_per_sequence == pytest.approx(0.05)


def test_idle_gaps_and_short_prompts_teach_nothing():
    costs = StepCostLearner()
    costs.decode_step(1, 30.0)  # the engine sat idle between two requests
    costs.finished_request(prefill_s=0.5, prompt_tokens=MIN_PREFILL_TOKENS - 1, cached_tokens=0)
    costs.finished_request(prefill_s=0.5, prompt_tokens=1000, cached_tokens=990)  # KV received
    assert costs.costs().decode_base_s == 0 and costs.prefill_s_per_token == 0
    costs.finished_request(prefill_s=3.0, prompt_tokens=1000, cached_tokens=0)
    assert costs.prefill_s_per_token == pytest.approx(0.003)


def test_vllm_iteration_stats_feed_the_costs():
    """The figures come from vLLM's own IterationStats (the real class)."""
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

    costs = StepCostLearner()
    decode_step = IterationStats()
    decode_step.inter_token_latencies_iter = [0.04, 0.04, 0.04]
    first_token_step = IterationStats()
    first_token_step.time_to_first_tokens_iter = [2.0]
    first_token_step.inter_token_latencies_iter = [2.0]  # stalled by the prefill: not a decode
    first_token_step.finished_requests = [
        FinishedRequestStats(
            finish_reason=None, num_prompt_tokens=800, num_cached_tokens=0, prefill_time=2.4
        )
    ]
    costs.record_iteration(decode_step)
    costs.record_iteration(first_token_step)
    fit = costs.costs()
    assert fit.decode_base_s + 3 * fit.decode_s_per_sequence == pytest.approx(0.04)
    assert costs.prefill_s_per_token == pytest.approx(0.003)


def test_prompts_computed_beside_others_do_not_inflate_the_prefill_cost():
    """Two prompts computed together each take twice their own time; the router already counts
    the other one (in the queue), so the cost learned stays the lone prompt's."""
    costs = StepCostLearner()
    for _ in range(4):
        costs.finished_request(prefill_s=1.0, prompt_tokens=1000, cached_tokens=0)
    for _ in range(8):
        costs.finished_request(prefill_s=2.0, prompt_tokens=1000, cached_tokens=0)
    assert costs.prefill_s_per_token == pytest.approx(0.001)


def test_a_prompt_cached_on_its_decode_worker_is_not_sent_to_be_recomputed():
    """The prefill worker is idle and the decode worker's queue is short, but the decode worker
    holds 1,400 of the prompt's 1,500 tokens (what cache-aware routing tracks)."""
    decode = worker_state(fake_worker(sent_per_second=(1, SHORT)), DEFAULT_COSTS, 1400)
    cold = decide(LONG, state(sent_per_second=(1, SHORT)), state())
    warm = decide(LONG, decode, state())
    assert cold.route == RoutePath.DISAGGREGATED and warm.route == RoutePath.LOCAL


SAMPLING = worker_pb2.SamplingParams(max_tokens=8)
FORCED = RouteDecision(RoutePath.DISAGGREGATED, RouteReason.HEADER)


def choice_over(*workers: FakeWorker, policy=None) -> WorkerChoice:
    pool = WorkerPool([])
    pool.workers = list(workers)
    return WorkerChoice(pool, policy or RoundRobin())


def test_choose_pairs_a_forced_disaggregated_request_without_an_event_loop():
    decode, prefill = FakeWorker("decode-a"), FakeWorker("prefill-a", Role.PREFILL)
    choice = choice_over(decode, prefill)
    view = choice.prompt_view(range(LONG))
    attempt = choose(choice, view, RouterSettings(model="m"), SAMPLING, FORCED)
    assert (attempt.decode, attempt.prefill, attempt.decision) == (decode, prefill, FORCED)
    assert attempt.route == RoutePath.DISAGGREGATED and attempt.fetch is None
    assert attempt.unpaired is None


def test_choose_goes_local_with_no_prefill_worker_left_to_try_and_says_why_when_none_pairs():
    decode, prefill = FakeWorker("decode-a"), FakeWorker("prefill-a", Role.PREFILL)
    choice = choice_over(decode, prefill)
    view, settings = choice.prompt_view(range(LONG)), RouterSettings(model="m")
    tried = Tried(prefill=frozenset({prefill.address}))
    attempt = choose(choice, view, settings, SAMPLING, tried=tried)
    assert attempt.prefill is None and attempt.unpaired is None
    assert attempt.decision == RouteDecision(RoutePath.LOCAL, RouteReason.NO_PREFILL_WORKER)
    prefill.identity.kv_compatibility = (
        "another model"  # forced, but nothing pairs with the decode worker
    )
    attempt = choose(choice, view, settings, SAMPLING, FORCED)
    assert attempt.route == RoutePath.LOCAL and attempt.prefill is None
    assert "KV is compatible with worker decode-a's" in attempt.unpaired


def test_choose_skips_the_decode_workers_tried_and_is_a_503_with_none_left():
    gone, spare = FakeWorker("decode-a"), FakeWorker("decode-b")
    choice = choice_over(gone, spare)
    view, settings = choice.prompt_view(range(SHORT)), RouterSettings(model="m")
    tried = Tried(decode=frozenset({gone.address}))
    assert {choose(choice, view, settings, SAMPLING, tried=tried).decode for _ in range(3)} == {
        spare
    }
    with pytest.raises(OpenAIError) as caught:
        choose(
            choice, view, settings, SAMPLING, tried=Tried(frozenset({gone.address, spare.address}))
        )
    assert caught.value.status == 503


def test_the_prompt_view_is_what_the_workers_held_before_the_run_sent_anything():
    """The view is made once per run: telling the policy that a worker now computes the prompt
    changes the next run's view, not this one's."""
    decode = FakeWorker("decode-a")
    choice = choice_over(decode, policy=CacheAware())
    prompt = list(range(1000, 1300))
    view = choice.prompt_view(prompt)
    choice.policy.computes(decode, prompt)
    assert view.cached_on(decode) == 0
    assert choice.prompt_view(prompt).cached_on(decode) == 256  # 4 whole chunks of 64
