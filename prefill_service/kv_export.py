"""KV export, prefill side: ship each finished prompt's KV blocks to the decode
instance that reserved room for them.

A request's transfer starts in the step that schedules its last prefill chunk:
only then is every layer's KV of every block final, and in that step the KV of
layer L is final as soon as the model has written layer L. So, with layer-wise
sending (the default), each layer is queued from the model runner's
on_layer_kv_written hook while the forward pass goes on to the next layer, and
`finish` follows the step. The source blocks stay held (the scheduler's
hold_finished_blocks) until the transfer's future resolves: zmq reads them
zero-copy until then.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.executor import Executor
from common.engine.outputs import RunnerOutput, SchedulerOutput
from kv_transfer import KVTarget, PoolGeometry, SendTransfer, TransferResult, TransferState, ZmqKVSender
from kv_transfer.base import check_transfer_id
from kv_transfer.zmq_common import check_endpoint

logger = logging.getLogger(__name__)


class TargetMismatchError(ValueError):
    """The decode pool's geometry differs from ours (layers, dtype or block shape)."""


@dataclass(eq=False)
class ExportTarget:
    """Where one request's KV goes: the receiver's target, and the first prompt block
    it wants (earlier blocks are already in the decode instance's prefix cache).
    `transfer` is set on the engine thread when the transfer starts, before the
    request's output is delivered, so the request's handler can always read it."""

    target: KVTarget
    first_block_index: int
    transfer: SendTransfer | None = None


def make_export_target(*, endpoint: str, transfer_id: str, dst_block_ids: list[int], first_block_index: int,
                       num_layers: int, dtype: str, block_shape: list[int], timeout_s: float,
                       num_prompt_tokens: int, geometry: PoolGeometry) -> ExportTarget:
    """Check a KV target against the prompt and our pool before any work is done."""
    check_transfer_id(transfer_id)
    check_endpoint(endpoint)
    block_size = geometry.block_shape[0]
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    if not 0 <= first_block_index < num_prompt_blocks:
        raise ValueError(f"kv_target.first_block_index {first_block_index} is outside the prompt's "
                         f"{num_prompt_blocks} blocks")
    if len(dst_block_ids) != num_prompt_blocks - first_block_index:
        raise ValueError(f"kv_target has {len(dst_block_ids)} destination blocks; a prompt of "
                         f"{num_prompt_tokens} tokens from block {first_block_index} on needs "
                         f"{num_prompt_blocks - first_block_index} (block size {block_size})")
    if (num_layers, dtype, tuple(block_shape)) != (geometry.num_layers, geometry.dtype, geometry.block_shape):
        raise TargetMismatchError(
            f"decode pool has {num_layers} layers of {dtype} blocks {list(block_shape)}, this prefill pool "
            f"{geometry.num_layers} layers of {geometry.dtype} blocks {list(geometry.block_shape)}")
    if not timeout_s > 0:
        raise ValueError("kv_target timeout must be > 0")
    target = KVTarget(transfer_id=transfer_id, endpoint=endpoint, dst_block_ids=tuple(dst_block_ids),
                      num_layers=num_layers, dtype=dtype, block_shape=tuple(block_shape),
                      deadline=time.time() + timeout_s)
    return ExportTarget(target, first_block_index)


class KVExporter:
    def __init__(self, kv_caches, layerwise: bool = True):
        self.sender = ZmqKVSender(kv_caches)
        self.geometry = PoolGeometry.of(kv_caches)
        self.layerwise = layerwise
        # Called (on any thread) with the request id once its transfer ended: the
        # owner then releases the held blocks on the engine thread.
        self.on_transfer_end: Callable[[str], None] | None = None
        # Called (on any thread) with each transfer once it ended and its KV bytes: metrics.
        self.transfer_observer: Callable[[SendTransfer, int], None] | None = None
        self._lock = threading.Lock()  # _expected is written by RPC handlers, read by the engine thread
        self._expected: dict[str, ExportTarget] = {}  # waiting for their last prefill chunk
        self._transfers: dict[str, SendTransfer] = {}  # started, blocks not yet released
        self._this_step: list[SendTransfer] = []  # engine thread only

    # ---- any thread -----------------------------------------------------------------
    def expect(self, req_id: str, export: ExportTarget) -> None:
        with self._lock:
            self._expected[req_id] = export

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._expected.pop(req_id, None)

    def transfer(self, req_id: str) -> SendTransfer | None:
        with self._lock:
            return self._transfers.get(req_id)

    def open_transfer_ids(self) -> list[str]:
        with self._lock:
            return list(self._transfers)

    def drop(self, req_id: str) -> None:
        with self._lock:
            self._transfers.pop(req_id, None)

    # ---- engine thread, around one step -----------------------------------------------
    def begin_step(self, scheduler_output: SchedulerOutput) -> bool:
        """Start the transfers of requests whose last prompt chunk runs in this step."""
        for scheduled in scheduler_output.scheduled:
            if not scheduled.do_sample:  # a partial chunk: more prompt KV still to come
                continue
            with self._lock:
                export = self._expected.pop(scheduled.req_id, None)
            if export is None:
                continue
            src_block_ids = scheduled.block_table[export.first_block_index:]
            try:
                transfer = self.sender.start(src_block_ids, export.target)
            except (ValueError, RuntimeError) as e:  # sender closed, or a target we failed to vet
                transfer = SendTransfer(export.target, [])
                transfer.state = TransferState.FAILED
                transfer.future.set_result(TransferResult(transfer.transfer_id, TransferState.FAILED, str(e)))
            export.transfer = transfer
            with self._lock:
                self._transfers[scheduled.req_id] = transfer
            req_id = scheduled.req_id
            transfer.future.add_done_callback(lambda _f, req_id=req_id, t=transfer: self._ended(req_id, t))
            self._this_step.append(transfer)
        return bool(self._this_step)

    def on_layer_kv_written(self, layer_idx: int) -> None:
        for transfer in self._this_step:
            self.sender.send_layer(transfer, layer_idx)

    def end_step(self, forward_ok: bool) -> None:
        for transfer in self._this_step:
            if not forward_ok:
                self.sender.abort(transfer, "prefill forward pass failed")
                continue
            if not self.layerwise:
                for layer_idx in range(self.geometry.num_layers):
                    if not self.sender.send_layer(transfer, layer_idx):
                        break
            self.sender.finish(transfer)
        self._this_step.clear()

    def _ended(self, req_id: str, transfer: SendTransfer) -> None:
        if self.transfer_observer is not None:
            self.transfer_observer(transfer, self.geometry.kv_bytes(len(transfer.target.dst_block_ids)))
        if self.on_transfer_end is not None:
            self.on_transfer_end(req_id)

    def close(self) -> None:
        self.sender.close()


class KVExportingExecutor(Executor):
    """Wraps the engine's executor: sets the runner's per-layer hook for the steps that
    finish a prompt with a KV target, and finishes their transfers after the step."""

    def __init__(self, inner: Executor, exporter: KVExporter):
        self.inner = inner
        self.exporter = exporter
        self.runner = inner.runner  # the layer hook lives on the in-process runner

    @property
    def device_type(self) -> str:
        return self.inner.device_type

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        exporting = self.exporter.begin_step(scheduler_output)
        if exporting and self.exporter.layerwise:
            self.runner.on_layer_kv_written = self.exporter.on_layer_kv_written
        forward_ok = False
        try:
            output = self.inner.execute_model(scheduler_output)
            forward_ok = True
            return output
        finally:
            self.runner.on_layer_kv_written = None
            if exporting:
                self.exporter.end_step(forward_ok)

    def kv_bytes_per_block(self) -> int:
        return self.inner.kv_bytes_per_block()

    def free_memory_bytes(self) -> int:
        return self.inner.free_memory_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.inner.allocate_kv_cache(num_blocks)

    def shutdown(self) -> None:
        self.inner.shutdown()
