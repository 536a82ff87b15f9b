"""The connector seam on the scheduler side, with hand-built RunnerOutputs (no model, no
transport): blocks a transfer may touch are held until the worker half reports the
transfer ended; an import runs only once its receive ended well; failures and aborts
free everything exactly once. block_size 4 throughout."""
from __future__ import annotations

import dataclasses
import time

import msgpack

from common.engine.kv_connector.base import KVConnectorScheduler
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVTransferOutcome
from common.engine.kv_connector.transfer_scheduler import TransferConnectorScheduler
from common.engine.outputs import RunnerOutput, SchedulerOutput
from common.engine.request import RequestStatus
from tests.unit.common.engine.test_scheduler import make_request, runner_output

BLOCK_SIZE = 4


def producer(make_scheduler, **kwargs):
    return make_scheduler(kv_connector=TransferConnectorScheduler("producer", BLOCK_SIZE), **kwargs)


def consumer(make_scheduler, **kwargs):
    return make_scheduler(kv_connector=TransferConnectorScheduler("consumer", BLOCK_SIZE), **kwargs)


def exporting(req_id: str, num_prompt_tokens: int, first_block_index: int = 0):
    request = make_request(req_id, num_prompt_tokens, max_tokens=1)
    request.kv_transfer_params = {"target": {"transfer_id": f"t-{req_id}", "endpoint": "tcp://d:1"},
                                  "first_block_index": first_block_index}
    return request


def importing(req_id: str, num_prompt_tokens: int = 0, prompt_token_ids: list[int] | None = None):
    request = make_request(req_id, num_prompt_tokens, prompt_token_ids=prompt_token_ids)
    request.kv_transfer_params = {"transfer_id": f"t-{req_id}", "timeout_s": 5.0}
    return request


def ended(req_id: str, direction: str, state: str = "done") -> KVTransferOutcome:
    return KVTransferOutcome(req_id=req_id, transfer_id=f"t-{req_id}", direction=direction, state=state)


def step(scheduler, outcomes: list[KVTransferOutcome] = ()):
    """One step whose runner reports `outcomes` as the transfers that ended."""
    scheduler_output = scheduler.schedule()
    output = runner_output(scheduler_output)
    output.kv_transfer_outcomes = list(outcomes)
    output.finished_sending = [o.req_id for o in outcomes if o.direction == "send"]
    output.finished_recving = [o.req_id for o in outcomes if o.direction == "recv"]
    return scheduler_output, scheduler.update_from_output(scheduler_output, output)


# ---- producer ------------------------------------------------------------------------------

def test_send_starts_with_the_last_chunk_and_holds_blocks_until_finished_sending(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8, max_num_batched_tokens=8)
    scheduler.add_request(exporting("p", 10, first_block_index=1))
    first, _ = step(scheduler)
    assert first.kv_connector_metadata.sends == []  # a partial chunk: the KV is not final yet
    last, outputs = step(scheduler)
    assert [o.finish_reason for o in outputs] == ["length"]
    assert [(s.req_id, s.src_block_ids, s.target["transfer_id"]) for s in last.kv_connector_metadata.sends] == [
        ("p", [1, 2], "t-p")]  # from first_block_index on
    assert "p" in scheduler.held_requests and scheduler.kv_cache_manager.num_free_blocks == 5
    for _ in range(3):  # steps that report nothing, or other transfers, keep the blocks
        step(scheduler, [ended("other", "send")])
        assert scheduler.kv_cache_manager.num_free_blocks == 5 and scheduler.has_open_kv_transfers()
    step(scheduler, [ended("p", "send", "failed")])  # any end releases them, exactly once
    assert not scheduler.held_requests and scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_open_kv_transfers()
    step(scheduler, [ended("p", "send")])
    assert scheduler.kv_cache_manager.num_free_blocks == 8


def test_the_transfer_timeout_starts_when_the_send_does_not_while_the_request_queued(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8, max_num_batched_tokens=8)
    request = exporting("p", 10)
    whole_deadline = time.time() + 100.0
    request.kv_transfer_params["target"]["deadline"] = whole_deadline
    request.kv_transfer_params["transfer_timeout_s"] = 2.0
    scheduler.add_request(request)
    step(scheduler)  # the first chunk: nothing is sent yet, however long it queued
    before = time.time()
    last, _ = step(scheduler)
    [send] = last.kv_connector_metadata.sends
    assert before + 2.0 <= send.target["deadline"] <= time.time() + 2.0  # counted from the send's start
    assert request.kv_transfer_params["target"]["deadline"] == whole_deadline  # the request's own is kept
    # The target's deadline still bounds the whole: a send starting late gets what is left of it.
    late = exporting("q", 4)
    late.kv_transfer_params["target"]["deadline"] = time.time() + 0.5
    late.kv_transfer_params["transfer_timeout_s"] = 2.0
    scheduler.add_request(late)
    out, _ = step(scheduler)
    assert out.kv_connector_metadata.sends[0].target["deadline"] == late.kv_transfer_params["target"]["deadline"]
    step(scheduler, [ended("p", "send"), ended("q", "send")])


def test_a_send_that_ends_in_its_own_step_still_frees_the_blocks(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8)
    scheduler.add_request(exporting("p", 6))
    scheduler_output = scheduler.schedule()
    output = runner_output(scheduler_output)
    output.kv_transfer_outcomes = [ended("p", "send", "failed")]
    outputs = scheduler.update_from_output(scheduler_output, output)
    assert outputs[0].finish_reason == "length"
    assert not scheduler.held_requests and scheduler.kv_cache_manager.num_free_blocks == 8


def test_abort_before_the_last_chunk_never_sends_and_frees_at_once(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8, max_num_batched_tokens=4)
    scheduler.add_request(exporting("p", 10))
    step(scheduler)
    assert [o.finish_reason for o in scheduler.abort_requests(["p"])] == ["abort"]
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.has_open_kv_transfers()
    assert scheduler.schedule().kv_connector_metadata == KVConnectorMetadata()


def test_abort_of_a_held_request_stops_its_send_and_waits_for_its_end(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8)
    scheduler.add_request(exporting("p", 6))
    step(scheduler)
    assert scheduler.abort_requests(["p"]) == [] and scheduler.abort_requests(["p"]) == []
    metadata = scheduler.schedule().kv_connector_metadata
    assert metadata.abort_req_ids == ["p"] and metadata.abort_reason["p"]
    assert scheduler.kv_cache_manager.num_free_blocks == 6  # the transport may still read them
    step(scheduler, [ended("p", "send", "failed")])
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.has_open_kv_transfers()


def test_a_send_carries_the_prompts_blocks_and_not_one_taken_ahead(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=32, num_blocks_ahead=3)
    # 12 tokens fill three blocks; its one sampled token takes a fourth, ahead.
    scheduler.add_request(exporting("p", 12, first_block_index=1))
    out, _ = step(scheduler)
    assert out.scheduled[0].block_table == [0, 1, 2, 3]
    assert [s.src_block_ids for s in out.kv_connector_metadata.sends] == [[1, 2]]
    step(scheduler, [ended("p", "send")])
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == 32


def test_a_request_without_kv_transfer_params_is_plain(make_scheduler):
    scheduler = producer(make_scheduler, num_blocks=8)
    scheduler.add_request(make_request("plain", 6, max_tokens=1))
    out, _ = step(scheduler)
    assert out.kv_connector_metadata.sends == [] and scheduler.kv_cache_manager.num_free_blocks == 8


# ---- consumer -----------------------------------------------------------------------------

def test_import_runs_only_after_its_receive_ended(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=8)
    shared = list(range(100, 104))
    scheduler.add_request(make_request("local", prompt_token_ids=shared + [1], max_tokens=1))
    step(scheduler)  # caches block [100..103]
    request = importing("r", prompt_token_ids=shared + list(range(200, 206)))
    reservation = scheduler.reserve_remote_kv(request)
    assert reservation.num_cached_tokens == 4
    metadata = scheduler.schedule_kv_connector_only().kv_connector_metadata
    assert metadata.recvs == [KVRecvSpec("r", "t-r", reservation.block_ids[1:], 5.0)]  # past the local hit
    assert scheduler.stats["num_importing"] == 1

    assert scheduler.finish_remote_kv("r", [42]) == []  # first token known, KV not landed yet
    out, outputs = step(scheduler)
    assert out.is_empty and outputs == [] and request.status is RequestStatus.WAITING_FOR_REMOTE_KV
    _, outputs = step(scheduler, [ended("r", "recv")])
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("r", [42])]
    out, _ = step(scheduler)
    assert [(s.req_id, s.token_ids) for s in out.scheduled] == [("r", [42])]
    assert not scheduler.has_open_kv_transfers() and scheduler.stats["num_importing"] == 0


def test_an_import_receives_into_its_prompts_blocks_and_decodes_into_those_taken_ahead(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=32, num_blocks_ahead=3)
    reservation = scheduler.reserve_remote_kv(importing("r", 10))  # 3 blocks, max_tokens 100
    assert reservation.block_ids == [0, 1, 2]
    metadata = scheduler.schedule_kv_connector_only().kv_connector_metadata
    assert [r.dst_block_ids for r in metadata.recvs] == [[0, 1, 2]]
    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("r") == [0, 1, 2, 3, 4, 5] and kv.block_pool.num_free_blocks == 26
    step(scheduler, [ended("r", "recv")])
    scheduler.finish_remote_kv("r", [42])
    for _ in range(13):  # up to 24 tokens: the blocks taken ahead hold them
        out, _ = step(scheduler)
        assert out.scheduled[0].block_table == [0, 1, 2, 3, 4, 5]
    assert kv.block_pool.num_free_blocks == 26


def test_import_whose_receive_ended_first_runs_when_its_first_token_comes(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=8)
    scheduler.reserve_remote_kv(importing("r", 6))
    step(scheduler, [ended("r", "recv")])
    assert [o.new_token_ids for o in scheduler.finish_remote_kv("r", [9])] == [[9]]
    assert scheduler.running and scheduler.running[0].req_id == "r"


def test_failed_receive_keeps_the_reservation_until_its_owner_fails_it(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=8)
    scheduler.reserve_remote_kv(importing("r", 6))
    _, outputs = step(scheduler, [ended("r", "recv", "expired")])
    assert outputs == [] and scheduler.kv_cache_manager.num_free_blocks == 6
    assert scheduler.finish_remote_kv("r", [9]) == []  # never runs on KV that did not land
    assert [o.finish_reason for o in scheduler.fail_remote_kv("r")] == ["abort"]
    assert scheduler.fail_remote_kv("r") == [] and scheduler.abort_requests(["r"]) == []
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.has_unfinished_requests()


def test_failed_receive_falls_back_to_a_local_prefill(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=8)
    scheduler.reserve_remote_kv(importing("r", 6))
    scheduler.cancel_remote_kv("r", "the Prefill call failed")
    assert scheduler.schedule().kv_connector_metadata.abort_req_ids == ["r"]
    assert scheduler.kv_cache_manager.num_free_blocks == 6  # still reserved: a write may follow
    step(scheduler, [ended("r", "recv", "failed")])
    scheduler.fail_remote_kv("r")
    scheduler.add_request(make_request("r", 6))
    out, _ = step(scheduler)
    assert [(s.req_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [("r", 0, 6)]


def test_abort_while_receiving_frees_once_the_receive_ended(make_scheduler):
    scheduler = consumer(make_scheduler, num_blocks=8)
    scheduler.reserve_remote_kv(importing("r", 6))
    assert scheduler.abort_requests(["r"]) == [] and scheduler.abort_requests(["r"]) == []
    assert scheduler.remote_kv_aborting("r") and scheduler.finish_remote_kv("r", [1]) == []
    metadata = scheduler.schedule().kv_connector_metadata
    assert metadata.recvs[0].req_id == "r" and metadata.abort_req_ids == ["r"]  # registered, then cancelled
    assert scheduler.kv_cache_manager.num_free_blocks == 6
    _, outputs = step(scheduler, [ended("r", "recv", "failed")])
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("r", "abort")]
    _, outputs = step(scheduler, [ended("r", "recv", "failed")])
    assert outputs == [] and scheduler.kv_cache_manager.num_free_blocks == 8
    assert not scheduler.has_unfinished_requests() and not scheduler.has_open_kv_transfers()


# ---- the seam itself ---------------------------------------------------------------------------

class FakeConnector(KVConnectorScheduler):
    """Holds every finished request with kv_transfer_params until told its send ended."""

    def __init__(self):
        self.open_req_ids: set[str] = set()
        self.aborted: list[str] = []
        self.allocated: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_tokens - num_computed_tokens if request.kv_transfer_params else 0

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.allocated.append((request.req_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput):
        return KVConnectorMetadata(abort_req_ids=list(self.aborted))

    def request_finished(self, request):
        if request.kv_transfer_params:
            self.open_req_ids.add(request.req_id)
        return request.req_id in self.open_req_ids

    def request_aborted(self, req_id, reason):
        self.aborted.append(req_id)

    def update_connector_output(self, outcomes):
        self.open_req_ids -= {o.req_id for o in outcomes}

    def has_open_transfers(self):
        return bool(self.open_req_ids)


def test_any_connector_decides_which_finished_requests_hold_their_blocks(make_scheduler):
    connector = FakeConnector()
    scheduler = make_scheduler(num_blocks=8, kv_connector=connector)
    scheduler.add_request(exporting("held", 6))
    scheduler.add_request(make_request("freed", 3, max_tokens=1))
    step(scheduler)
    assert connector.allocated == [("held", [0, 1], 0), ("freed", [2], 0)]
    assert list(scheduler.held_requests) == ["held"] and scheduler.kv_cache_manager.num_free_blocks == 6
    scheduler.abort_requests(["held"])
    assert connector.aborted == ["held"] and scheduler.kv_cache_manager.num_free_blocks == 6
    step(scheduler, [ended("held", "send")])
    assert scheduler.kv_cache_manager.num_free_blocks == 8 and not scheduler.has_open_kv_transfers()


def test_connector_metadata_and_outcomes_are_msgpack_plain_data(make_scheduler):
    scheduler = producer(make_scheduler)
    scheduler.add_request(exporting("p", 6))
    metadata = scheduler.schedule().kv_connector_metadata
    scheduler.abort_requests(["p"])
    outcome = KVTransferOutcome("p", "t-p", "send", "failed", "peer lost", 1024, 1.5, None, 2.5)
    output = RunnerOutput(req_ids=["p"], sampled_token_ids=[[7]], finished_sending=["p"],
                          kv_transfer_outcomes=[outcome])
    assert [s.req_id for s in metadata.sends] == ["p"]
    for value in (metadata, outcome):
        wire = msgpack.unpackb(msgpack.packb(dataclasses.asdict(value)))
        assert dataclasses.asdict(value) == wire
    assert msgpack.unpackb(msgpack.packb(dataclasses.asdict(output)))["finished_sending"] == ["p"]
    scheduler.update_from_kv_transfers([outcome])  # aborted mid-step, its send started: held till now
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks
