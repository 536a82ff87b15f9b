"""The engine in the prefill role.

Each request is prefilled (chunked, reusing cached prefix blocks), samples its
first token with the caller's sampling parameters, and finishes. Its blocks are
held until its KV transfer has ended, then released (they stay in the prefix
cache until evicted). Abort never frees blocks a transfer may still be reading:
it aborts the transfer, and the blocks go back when the transfer's future resolves.
"""
from __future__ import annotations

from common.engine.config import EngineConfig
from common.engine.engine_core import EngineCore
from common.engine.outputs import EngineCoreOutput
from common.service.errors import DuplicateRequestError
from prefill_service.kv_events import KvEventPublisher
from prefill_service.kv_export import ExportTarget, KVExporter, KVExportingExecutor


class PrefillEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, *, layerwise_kv_send: bool = True,
                 events: KvEventPublisher | None = None):
        super().__init__(config, hold_finished_blocks=True)
        self.exporter = KVExporter(self.executor.runner.kv_caches, layerwise=layerwise_kv_send)
        self.executor = KVExportingExecutor(self.executor, self.exporter)
        self.events = events

    def admit(self, request, export: ExportTarget | None) -> None:
        """Queue a prefill; its KV goes to `export` when its last chunk runs."""
        if request.req_id in self.scheduler.requests or request.req_id in self.scheduler.held_requests:
            raise DuplicateRequestError(f"request {request.req_id!r} is already in flight on this instance")
        if export is not None:
            self.exporter.expect(request.req_id, export)
        try:
            self.add_request(request)
        except ValueError:
            self.exporter.forget(request.req_id)
            raise

    def step(self) -> list[EngineCoreOutput]:
        outputs = super().step()
        for output in outputs:  # nothing to ship: give the blocks back at once
            if output.finished and self.exporter.transfer(output.req_id) is None:
                self.scheduler.release_held_blocks(output.req_id)
        self.publish_kv_events()
        return outputs

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        plain = []
        for req_id in req_ids:
            self.exporter.forget(req_id)
            transfer = self.exporter.transfer(req_id)
            if transfer is not None and not transfer.future.done():
                # release_request runs when the sender has let go of the blocks.
                self.exporter.sender.abort(transfer, "prefill request aborted")
            else:
                self.exporter.drop(req_id)
                plain.append(req_id)
        return super().abort_requests(plain)

    def abort_all(self) -> list[EngineCoreOutput]:
        return self.abort_requests(list(self.scheduler.requests) + self.exporter.open_transfer_ids())

    def release_request(self, req_id: str) -> None:
        """Free a finished request's held blocks once its transfer has ended (idempotent)."""
        transfer = self.exporter.transfer(req_id)
        if transfer is not None and not transfer.future.done():
            return
        self.exporter.drop(req_id)
        self.scheduler.release_held_blocks(req_id)

    def publish_kv_events(self) -> None:
        if self.events is not None:
            self.events.publish(self.kv_cache_manager.take_events())

    def stats(self) -> dict:
        stats = super().stats()
        stats["num_sending"] = len(self.exporter.open_transfer_ids())
        stats["kv_events_sequence"] = self.events.last_published_seq if self.events else 0
        return stats

    def shutdown(self) -> None:
        super().shutdown()
        self.exporter.close()
        if self.events is not None:
            self.events.close()
