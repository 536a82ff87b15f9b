"""Worker half of the connector over kv_transfer's push transports: owns a KV sender
(producer) or a KV receiver (consumer) over this runner's pool.

Sends start before the forward pass of the step that runs a prompt's last chunk; with
layer-wise sending each layer is queued from save_kv_layer while the pass goes on to
the next layer, else every layer in wait_for_save. Transports end transfers on their
own threads; get_finished hands the ended ones over on the runner's thread.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from common.engine.config import KVTransferConfig
from common.engine.kv_connector.base import KVConnectorWorker
from common.engine.kv_connector.metadata import KVConnectorMetadata, KVTransferOutcome
from kv_transfer import (
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


class TransferConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig):
        if config.role not in ("producer", "consumer"):
            raise ValueError(f"a transfer connector is a producer or a consumer; got {config.role!r}")
        self.config = config
        self.geometry: PoolGeometry | None = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._sends: dict[str, SendTransfer] = {}  # req_id -> open send (runner thread only)
        self._recv_transfer_ids: dict[str, str] = {}  # req_id -> transfer id of its open receive
        self._this_step_sends: list[SendTransfer] = []
        self._lock = threading.Lock()  # _ended is appended to by the transports' threads
        self._ended: list[KVTransferOutcome] = []

    # ---- set-up --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list) -> None:
        self.geometry = PoolGeometry.of(kv_caches)
        backend = self.config.backend
        if self.config.role == "producer":
            self.sender = ZmqKVSender(kv_caches) if backend == "zmq" else TorchDistKVSender(kv_caches)
        elif backend == "zmq":
            self.receiver = ZmqKVReceiver(kv_caches, self.config.bind_endpoint)
        else:
            host, _, port = self.config.bind_endpoint.split("://")[-1].rpartition(":")
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
                self.sender.abort(self._sends[req_id], reason)
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
        try:
            transfer = self.sender.start(src_block_ids, target)
        except (ValueError, RuntimeError, KeyError, TypeError) as e:  # sender closed, or a target not vetted
            self._report_failed(req_id, "send", str(target.get("transfer_id", "")), str(e))
            return
        self._sends[req_id] = transfer
        self._this_step_sends.append(transfer)
        num_bytes = self.geometry.kv_bytes(len(transfer.target.dst_block_ids))
        transfer.future.add_done_callback(lambda _f: self._report(req_id, "send", transfer, num_bytes))

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
