"""The connectors' scheduler sides, driven by fake scheduler outputs (no engine): which blocks
a prefill worker's send plan sends at each step, chunked prefill included, and what a decode
worker's load plan expects."""

from dataclasses import dataclass, field

from decode_workers.load_plan import LoadPlan
from kv_transfer.params import ReceiveKv, SendKv, to_extra_args
from prefill_workers.send_plan import SendPlan

BLOCK = 128


@dataclass
class FakeSamplingParams:
    extra_args: dict


@dataclass
class FakeNewRequest:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: FakeSamplingParams
    num_computed_tokens: int = 0


@dataclass
class FakeBlockState:
    blocks: dict[str, list[int]]

    def get_block_ids(self, req_id):
        return (self.blocks[req_id],) if req_id in self.blocks else None


@dataclass
class FakeSchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    kv_connector_block_state: FakeBlockState
    scheduled_new_reqs: list[FakeNewRequest] = field(default_factory=list)


def send_request(prompt_len: int, computed: int = 0) -> FakeNewRequest:
    params = to_extra_args(SendKv("t1", "decode:9000"))
    return FakeNewRequest("p1", list(range(prompt_len)), FakeSamplingParams(params), computed)


def test_a_prompt_in_one_step_sends_all_its_blocks_once():
    plan = SendPlan(BLOCK)
    step = FakeSchedulerOutput({"p1": 300}, FakeBlockState({"p1": [7, 3, 9]}), [send_request(300)])
    (piece,) = plan.sends(step)
    assert (piece.first_block, piece.block_ids, piece.last) == (0, [7, 3, 9], True)
    assert plan.sends(FakeSchedulerOutput({"p1": 1}, FakeBlockState({"p1": [7, 3, 9]}))) == []


def test_chunked_prefill_sends_each_steps_blocks_and_resends_a_partial_one():
    plan = SendPlan(BLOCK)
    blocks = FakeBlockState({"p1": [1, 2, 3, 4, 5]})
    first = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks, [send_request(600)]))[0]
    second = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks))[0]
    third = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks))[0]
    # Tokens 0-199 (blocks 0-1, block 1 partial), 200-399 (blocks 1-3), 400-599 (blocks 3-4).
    assert (first.first_block, first.block_ids, first.last) == (0, [1, 2], False)
    assert (second.first_block, second.block_ids, second.last) == (1, [2, 3, 4], False)
    assert (third.first_block, third.block_ids, third.last) == (3, [4, 5], True)


def test_a_local_prefix_hit_is_sent_too():
    plan = SendPlan(BLOCK)
    step = FakeSchedulerOutput(
        {"p1": 44}, FakeBlockState({"p1": [4, 5, 6]}), [send_request(300, computed=256)]
    )
    (piece,) = plan.sends(step)
    assert (piece.first_block, piece.block_ids, piece.last) == (0, [4, 5, 6], True)


@dataclass
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class FakeBlocks:
    def __init__(self, block_ids, fresh):
        self.block_ids, self.fresh = block_ids, fresh

    def get_block_ids(self):
        return (self.block_ids,)

    def get_unhashed_block_ids(self):
        return self.block_ids[-self.fresh :] if self.fresh else []


def test_a_decode_request_loads_its_whole_prompt_once():
    plan = LoadPlan(BLOCK)
    params = to_extra_args(ReceiveKv("t1", 5.0, 300))["kv_transfer_params"]
    request = FakeRequest("d1", list(range(300)), params)
    assert plan.get_num_new_matched_tokens(request, 256) == (44, True)
    plan.update_state_after_alloc(request, FakeBlocks([4, 5, 6], fresh=1), 44)
    (expected,) = plan.take_expected()
    assert (expected.transfer_id, expected.block_ids, expected.skip_blocks) == ("t1", [4, 5, 6], 2)
    # Asked again (after a failed load): nothing more to load, vLLM computes it.
    assert plan.get_num_new_matched_tokens(request, 0) == (0, False)
    plan.forget(request.request_id)
    assert plan.receiving == set()


def test_a_decode_request_that_goes_on_with_the_first_token_computes_only_that():
    plan = LoadPlan(BLOCK)
    params = to_extra_args(ReceiveKv("t2", 5.0, 300))["kv_transfer_params"]
    request = FakeRequest("d2", list(range(301)), params)  # the prompt + the first token
    assert plan.get_num_new_matched_tokens(request, 0) == (300, True)


def send_skipping(prompt_len: int, skip_tokens: int) -> FakeNewRequest:
    params = to_extra_args(SendKv("t1", "decode:9000", skip_tokens=skip_tokens))
    return FakeNewRequest("p1", list(range(prompt_len)), FakeSamplingParams(params))


def test_blocks_the_decode_worker_holds_are_not_sent_but_the_last_one_always_is():
    plan = SendPlan(BLOCK)
    blocks = FakeBlockState({"p1": [1, 2, 3, 4, 5]})
    # 300 tokens held: blocks 0-1 whole (block 2 is only partly held), chunked by 200.
    first = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks, [send_skipping(600, 300)]))
    second = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks))[0]
    third = plan.sends(FakeSchedulerOutput({"p1": 200}, blocks))[0]
    assert first == []  # tokens 0-199: blocks 0-1, both held
    assert (second.first_block, second.block_ids, second.last) == (2, [3, 4], False)
    assert (third.first_block, third.block_ids, third.last) == (3, [4, 5], True)
    whole = SendPlan(BLOCK)  # the decode worker holds the whole prompt: its last block still goes
    step = FakeSchedulerOutput(
        {"p1": 300}, FakeBlockState({"p1": [7, 3, 9]}), [send_skipping(300, 300)]
    )
    (piece,) = whole.sends(step)
    assert (piece.first_block, piece.block_ids, piece.last) == (2, [9], True)


def test_a_decode_worker_holding_the_skipped_blocks_loads_the_rest():
    plan = LoadPlan(BLOCK)
    params = to_extra_args(ReceiveKv("t3", 5.0, 600, skip_tokens=300))["kv_transfer_params"]
    request = FakeRequest("d3", list(range(600)), params)
    assert plan.get_num_new_matched_tokens(request, 256) == (344, True)
    plan.update_state_after_alloc(request, FakeBlocks([4, 5, 6, 7, 8], fresh=3), 344)
    (expected,) = plan.take_expected()
    assert expected.skip_blocks == 2 and plan.take_abandoned() == []


def test_a_decode_worker_lacking_the_skipped_blocks_computes_and_abandons_the_transfer():
    plan = LoadPlan(BLOCK)
    params = to_extra_args(ReceiveKv("t4", 5.0, 600, skip_tokens=300))["kv_transfer_params"]
    request = FakeRequest("d4", list(range(600)), params)
    assert plan.get_num_new_matched_tokens(request, 128) == (0, False)  # block 1 was evicted
    assert plan.take_abandoned() == ["t4"]
    assert plan.get_num_new_matched_tokens(request, 256) == (0, False)  # asked again: computed
    assert plan.take_abandoned() == [] and plan.take_expected() == []
    plan.forget(request.request_id)
    assert plan.computing == set()


def test_kv_every_rank_holds_is_loaded_in_the_step_that_schedules_its_request():
    """The ranks announced the transfer whole: a synchronous load (vLLM schedules the request
    now), its blocks past the local hit in this step's `loads`, none in `expected`."""
    plan = LoadPlan(BLOCK, arrived=lambda params: params.transfer_id == "t5")
    params = to_extra_args(ReceiveKv("t5", 5.0, 300))["kv_transfer_params"]
    request = FakeRequest("d5", list(range(301)), params)  # the prompt + the first token
    assert plan.get_num_new_matched_tokens(request, 128) == (172, False)
    # vLLM hashed every block this step fills already: the local hit (one block) says the skip.
    plan.update_state_after_alloc(request, FakeBlocks([4, 5, 6], fresh=0), 172)
    (load,) = plan.take_loads()
    assert (load.transfer_id, load.block_ids, load.skip_blocks) == ("t5", [4, 5, 6], 1)
    assert plan.take_expected() == [] and plan.take_loads() == []
    assert plan.get_num_new_matched_tokens(request, 0) == (0, False)  # after a failed load


def test_a_synchronous_load_of_the_whole_prompt_stops_one_token_short():
    """vLLM computes at least one token of a request it schedules (it samples from it)."""
    plan = LoadPlan(BLOCK, arrived=lambda params: True)
    params = to_extra_args(ReceiveKv("t6", 5.0, 300))["kv_transfer_params"]
    request = FakeRequest("d6", list(range(300)), params)
    assert plan.get_num_new_matched_tokens(request, 0) == (299, False)


def test_kv_not_all_announced_is_loaded_asynchronously_as_before():
    announced: set[str] = set()
    plan = LoadPlan(BLOCK, arrived=lambda params: params.transfer_id in announced)
    params = to_extra_args(ReceiveKv("t7", 5.0, 300))["kv_transfer_params"]
    request = FakeRequest("d7", list(range(301)), params)
    assert plan.get_num_new_matched_tokens(request, 0) == (300, True)
    plan.update_state_after_alloc(request, FakeBlocks([4, 5, 6], fresh=3), 300)
    (expected,) = plan.take_expected()
    assert expected.skip_blocks == 0 and plan.take_loads() == []
    announced.add("t7")  # too late: the request waits for the load it was admitted with
    assert plan.get_num_new_matched_tokens(request, 0) == (0, False)
