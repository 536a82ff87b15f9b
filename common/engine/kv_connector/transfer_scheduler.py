"""Scheduler half of the connector over kv_transfer's push transports (ZeroMQ,
torch.distributed).

Producer (prefill): a request whose kv_transfer_params name a target sends its prompt's
KV in the step that runs its last prompt chunk (only then is every layer of every block
final); its blocks are held from its finish until the send is reported ended.
Consumer (decode): a request with kv_transfer_params {"transfer_id", "timeout_s"} gets
every uncached prompt token from outside; its destination blocks are registered with the
receiver before any sender can reach them, and stay reserved until the receive ended.

kv_transfer_params (plain data on the Request):
  producer  {"target": KVTarget.to_dict(), "first_block_index": int,
             "transfer_timeout_s": float (optional)}
  consumer  {"transfer_id": str, "timeout_s": float}

A producer's transfer_timeout_s starts when the send is handed to the worker half (the
step of the last prompt chunk): time the request spent queued for a slot does not count,
only the target's own deadline bounds the whole.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.engine.kv_connector.base import KVConnectorScheduler
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVSendSpec, KVTransferOutcome

if TYPE_CHECKING:
    from common.engine.outputs import SchedulerOutput
    from common.engine.request import Request


class TransferConnectorScheduler(KVConnectorScheduler):
    def __init__(self, role: str, block_size: int):
        if role not in ("producer", "consumer"):
            raise ValueError(f"a transfer connector is a producer or a consumer; got {role!r}")
        self.role = role
        self.block_size = block_size
        # producer: admitted, last prompt chunk not run yet: (kv_transfer_params, the prompt's block count)
        self._export_params: dict[str, tuple[dict, int]] = {}
        self._sending_req_ids: set[str] = set()  # producer: handed to the worker, not reported ended
        self._pending_recvs: list[KVRecvSpec] = []  # consumer: not yet handed to the worker
        self._receiving_req_ids: set[str] = set()  # consumer: registered (or about to be), not ended
        self._pending_aborts: dict[str, str] = {}  # req_id -> reason, for the next metadata

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        if self.role != "consumer" or not params or "transfer_id" not in params:
            return 0
        return request.num_tokens - num_computed_tokens

    def update_state_after_alloc(self, request: "Request", block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        # Only the prompt's blocks cross: block_ids may go on past them (blocks taken ahead
        # for the tokens still to be generated), and those hold no KV.
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        if self.role == "producer":
            # Again after a preemption: the send still starts with the last chunk.
            self._export_params[request.req_id] = (params, num_prompt_blocks)
        elif num_external_tokens > 0:
            first_block_index = (request.num_tokens - num_external_tokens) // self.block_size
            self._pending_recvs.append(KVRecvSpec(
                req_id=request.req_id, transfer_id=params["transfer_id"],
                dst_block_ids=list(block_ids[first_block_index:num_prompt_blocks]),
                timeout_s=float(params["timeout_s"])))
            self._receiving_req_ids.add(request.req_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        sends = []
        for scheduled in scheduler_output.scheduled:
            if not scheduled.do_sample:  # a partial chunk: more prompt KV still to come
                continue
            export = self._export_params.pop(scheduled.req_id, None)
            if export is None:
                continue
            params, num_prompt_blocks = export
            target = params["target"]
            if params.get("transfer_timeout_s") is not None:
                target = target | {"deadline": min(target["deadline"], time.time() + params["transfer_timeout_s"])}
            first_block_index = params["first_block_index"]
            sends.append(KVSendSpec(req_id=scheduled.req_id,
                                    src_block_ids=list(scheduled.block_table[first_block_index:num_prompt_blocks]),
                                    target=target))
            self._sending_req_ids.add(scheduled.req_id)
        recvs, self._pending_recvs = self._pending_recvs, []
        aborts, self._pending_aborts = self._pending_aborts, {}
        return KVConnectorMetadata(sends=sends, recvs=recvs, abort_req_ids=list(aborts), abort_reason=aborts)

    def request_finished(self, request: "Request") -> bool:
        self._export_params.pop(request.req_id, None)  # never started: nothing to wait for
        return request.req_id in self._sending_req_ids or request.req_id in self._receiving_req_ids

    def request_aborted(self, req_id: str, reason: str) -> None:
        if req_id in self._sending_req_ids or req_id in self._receiving_req_ids:
            self._pending_aborts.setdefault(req_id, reason)

    def is_receiving(self, req_id: str) -> bool:
        return req_id in self._receiving_req_ids

    def update_connector_output(self, outcomes: list[KVTransferOutcome]) -> None:
        for outcome in outcomes:
            if outcome.direction == "send":
                self._sending_req_ids.discard(outcome.req_id)
            else:
                self._receiving_req_ids.discard(outcome.req_id)
            # An abort not yet handed over has nothing left to stop.
            if (outcome.req_id not in self._sending_req_ids
                    and outcome.req_id not in self._receiving_req_ids):
                self._pending_aborts.pop(outcome.req_id, None)

    def has_open_transfers(self) -> bool:
        return bool(self._sending_req_ids or self._receiving_req_ids or self._pending_aborts)

    def stats(self) -> dict[str, int]:
        return {"num_sending": len(self._sending_req_ids)}
