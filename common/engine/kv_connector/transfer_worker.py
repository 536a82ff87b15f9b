"""Worker half of the connector over kv_transfer's push transports: owns a KV sender
(producer) or a KV receiver (consumer) over this runner's pool.

Sends start before the forward pass of the step that runs a prompt's last chunk; with
layer-wise sending each layer is queued from save_kv_layer while the pass goes on to
the next layer, else every layer in wait_for_save. Transports end transfers on their
own threads; get_finished hands the ended ones over on the runner's thread.

Under tensor parallelism every rank runs one of these over its shard of the pool. A
consumer rank receives into its own receiver (its own endpoint); a producer rank sends
the head slices head_mapping assigns it to the decode ranks named in the target's
"rank_endpoints", possibly several slices to several ranks, and reports the request's
send once all of them ended. The executor joins the ranks' reports into one.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.base import KVConnectorWorker
from common.engine.kv_connector.head_mapping import plan_head_slices
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVTransferOutcome
from kv_transfer import (
    HeadRange,
    KVReceiver,
    KVSender,
    PoolGeometry,
    SendTransfer,
    TorchDistKVReceiver,
    TorchDistKVSender,
    TransferHandle,
    TransferResult,
    TransferState,
    ZmqKVReceiver,
    ZmqKVSender,
)


@dataclass(frozen=True)
class TPShard:
    """Which share of the KV heads this rank's pool holds."""

    tp_rank: int = 0
    tp_size: int = 1
    num_kv_heads: int = 0  # the model's; 0: the pool holds them all (tp_size 1)


@dataclass(eq=False)
class _SendGroup:
    """One request's sends from this rank (a slice per decode rank it feeds): it ends once all did."""

    transfers: list[SendTransfer]
    num_bytes: int
    started_at: float = field(default_factory=time.monotonic)
    results: list[tuple[TransferResult, TransferHandle]] = field(default_factory=list)
    error: str | None = None  # a slice could not start: the request's send fails


def bind_endpoint_of_rank(endpoint: str, tp_rank: int) -> str:
    """Where tensor-parallel rank tp_rank listens: port + tp_rank when a port is fixed, an
    ipc path of its own, an ephemeral port (0, *) as it is."""
    if tp_rank == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-rank{tp_rank}"
    head, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and int(port) > 0:
        return f"{head}:{int(port) + tp_rank}"
    return endpoint


class TransferConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, shard: TPShard | None = None):
        if config.role not in ("producer", "consumer"):
            raise ValueError(f"a transfer connector is a producer or a consumer; got {config.role!r}")
        self.config = config
        self.shard = shard or TPShard()
        self.geometry: PoolGeometry | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._sends: dict[str, _SendGroup] = {}  # req_id -> its open sends (runner thread only)
        self._recv_transfer_ids: dict[str, str] = {}  # req_id -> transfer id of its open receive
        self._this_step_sends: list[SendTransfer] = []
        self._lock = threading.Lock()  # _ended is appended to by the transports' threads
        self._ended: list[KVTransferOutcome] = []

    # ---- set-up --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.geometry = PoolGeometry.of(kv_caches)
        backend = self.config.backend
        bind_endpoint = bind_endpoint_of_rank(self.config.bind_endpoint, self.shard.tp_rank)
        if self.config.role == "producer":
            self.sender = ZmqKVSender(kv_caches) if backend == "zmq" else TorchDistKVSender(kv_caches)
        elif backend == "zmq":
            self.receiver = ZmqKVReceiver(kv_caches, bind_endpoint)
        else:
            host, _, port = bind_endpoint.split("://")[-1].rpartition(":")
            self.receiver = TorchDistKVReceiver(kv_caches, host or "127.0.0.1",
                                                0 if port in ("", "*") else int(port), backend)

    def info(self) -> dict[str, Any]:
        return self.geometry.to_dict() | {
            "role": self.config.role, "endpoint": self.receiver.endpoint if self.receiver is not None else ""}

    # ---- one step ---------------------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        for spec in metadata.recvs:
            self._register_recv(spec.req_id, spec.transfer_id, spec.dst_block_ids, spec.timeout_s)
        for req_id in metadata.abort_req_ids:
            reason = metadata.abort_reason.get(req_id, "aborted")
            if req_id in self._sends:
                for transfer in self._sends[req_id].transfers:
                    self.sender.abort(transfer, reason)
            elif req_id in self._recv_transfer_ids:
                self.receiver.cancel(self._recv_transfer_ids[req_id], reason)
        for spec in metadata.sends:
            self._start_send(spec.req_id, spec.src_block_ids, spec.target)

    def _register_recv(self, req_id: str, transfer_id: str, dst_block_ids: list[int], timeout_s: float) -> None:
        num_bytes = self.geometry.kv_bytes(len(dst_block_ids))
        try:
            transfer = self.receiver.register(transfer_id, dst_block_ids, timeout_s)
        except (ValueError, RuntimeError) as e:  # receiver closed, or a duplicate transfer id
            self._report_failed(req_id, "recv", transfer_id, f"could not register the KV transfer: {e}")
            return
        self._recv_transfer_ids[req_id] = transfer_id
        transfer.future.add_done_callback(
            lambda _f: self._report(req_id, "recv", transfer, num_bytes))

    def _start_send(self, req_id: str, src_block_ids: list[int], target: dict) -> None:
        """Start this rank's slices of req_id's KV; a rank with none to send reports done at once."""
        transfer_id = str(target.get("transfer_id", ""))
        try:
            slices = self._slices_of(target)
        except (ValueError, KeyError, TypeError) as e:  # a target not vetted
            self._report_failed(req_id, "send", transfer_id, str(e))
            return
        local_heads = self.geometry.block_shape[1]
        num_heads = sum(local_heads if heads is None else heads.num_heads for _, heads in slices)
        group = _SendGroup([], self.geometry.kv_bytes(len(src_block_ids)) * num_heads // local_heads)
        for slice_target, heads in slices:
            try:
                group.transfers.append(self.sender.start(src_block_ids, slice_target, heads))
            except (ValueError, RuntimeError, KeyError, TypeError) as e:  # sender closed, or a target not vetted
                group.error = str(e)
                break
        if group.error is not None:
            for transfer in group.transfers:  # they end through the transport: the outcome waits for them
                self.sender.abort(transfer, group.error)
        if not group.transfers:
            self._report_group(req_id, transfer_id, group)
            return
        self._sends[req_id] = group
        if group.error is None:
            self._this_step_sends.extend(group.transfers)
        for transfer in group.transfers:
            transfer.future.add_done_callback(lambda _f, t=transfer: self._on_send_ended(req_id, group, t))

    def _slices_of(self, target: dict) -> list[tuple[dict, HeadRange | None]]:
        """(the decode rank's target, the heads this rank sends it) per slice this rank owns;
        one whole-pool send when both sides run one rank or the same layout."""
        rank_endpoints = target.get("rank_endpoints") or [target["endpoint"]]
        shard = self.shard
        if len(rank_endpoints) == shard.tp_size:  # same split: rank r feeds rank r, every head
            return [(target | {"endpoint": rank_endpoints[shard.tp_rank]}, None)]
        if not shard.num_kv_heads:
            raise ValueError("this pool's share of the KV heads is unknown: cannot map it onto "
                             f"{len(rank_endpoints)} decode ranks")
        return [(target | {"endpoint": rank_endpoints[s.dst_rank]}, HeadRange(s.src_start, s.dst_start, s.num_heads))
                for s in plan_head_slices(shard.num_kv_heads, shard.tp_size, len(rank_endpoints))
                if s.src_rank == shard.tp_rank]

    @property
    def needs_layer_hook(self) -> bool:
        return bool(self._this_step_sends) and self.config.layerwise_send

    def wait_for_layer_load(self, layer_idx: int) -> None:
        pass  # pushed KV lands before its request is scheduled: nothing arrives mid-step

    def save_kv_layer(self, layer_idx: int) -> None:
        for transfer in self._this_step_sends:
            self.sender.send_layer(transfer, layer_idx)

    def wait_for_save(self) -> None:
        for transfer in self._this_step_sends:
            if not self.config.layerwise_send:
                for layer_idx in range(self.geometry.num_layers):
                    if not self.sender.send_layer(transfer, layer_idx):
                        break
            self.sender.finish(transfer)
        self._this_step_sends.clear()

    def abort_saves(self, reason: str) -> None:
        for transfer in self._this_step_sends:
            self.sender.abort(transfer, reason)
        self._this_step_sends.clear()

    def get_finished(self) -> list[KVTransferOutcome]:
        with self._lock:
            ended, self._ended = self._ended, []
        for outcome in ended:
            if outcome.direction == "send":
                self._sends.pop(outcome.req_id, None)
            else:
                self._recv_transfer_ids.pop(outcome.req_id, None)
        return ended

    # ---- transport threads --------------------------------------------------------------------
    def _report(self, req_id: str, direction: str, transfer: TransferHandle, num_bytes: int) -> None:
        result: TransferResult = transfer.future.result()
        with self._lock:
            self._ended.append(KVTransferOutcome(
                req_id=req_id, transfer_id=transfer.transfer_id, direction=direction, state=result.state.value,
                reason=result.reason, num_bytes=num_bytes, started_at=transfer.started_at,
                first_byte_at=transfer.first_byte_at, ended_at=transfer.ended_at))

    def _on_send_ended(self, req_id: str, group: _SendGroup, transfer: SendTransfer) -> None:
        with self._lock:
            group.results.append((transfer.future.result(), transfer))
            if len(group.results) < len(group.transfers):
                return
        self._report_group(req_id, group.transfers[0].transfer_id, group)

    def _report_group(self, req_id: str, transfer_id: str, group: _SendGroup) -> None:
        """The request's sends from this rank all ended: one outcome, failed if any slice failed."""
        failed = [result for result, _ in group.results if not result.ok]
        handles = [handle for _, handle in group.results]
        state, reason = TransferState.DONE.value, ""
        if group.error is not None:
            state, reason = TransferState.FAILED.value, group.error
        elif failed:
            state, reason = failed[0].state.value, failed[0].reason
        ended_at = max((h.ended_at for h in handles if h.ended_at is not None), default=time.monotonic())
        with self._lock:
            self._ended.append(KVTransferOutcome(
                req_id=req_id, transfer_id=transfer_id, direction="send", state=state, reason=reason,
                num_bytes=group.num_bytes, started_at=min((h.started_at for h in handles), default=group.started_at),
                ended_at=ended_at))

    def _report_failed(self, req_id: str, direction: str, transfer_id: str, reason: str) -> None:
        """A transfer that failed before the transport took it: it touches no block."""
        now = time.monotonic()
        with self._lock:
            self._ended.append(KVTransferOutcome(req_id=req_id, transfer_id=transfer_id, direction=direction,
                                                 state=TransferState.FAILED.value, reason=reason,
                                                 started_at=now, ended_at=now))

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
