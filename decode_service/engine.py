"""The engine in the decode role: owns a ZeroMQ KV receiver over its own pool.

Admission decides, atomically on the engine thread, between a local prefill (the
plain engine path) and a remote one: reserve the prompt's blocks
(scheduler.reserve_remote_kv) and register the expected transfer with the receiver.

Blocks a transfer may still write into are never freed early: aborting a request
whose KV is being imported cancels the transfer, and the reservation is released
only when the receiver confirms that no further write can follow (its future).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from common.engine.config import EngineConfig
from common.engine.engine_core import EngineCore
from common.engine.outputs import EngineCoreOutput
from common.engine.request import Request
from common.service.errors import DuplicateRequestError
from kv_transfer import PoolGeometry, RecvTransfer, ZmqKVReceiver

logger = logging.getLogger(__name__)


class Placement(enum.Enum):
    LOCAL = "local"  # prefilled here, the plain engine path
    REMOTE = "remote"  # blocks reserved, KV expected from a prefill instance
    FULL = "full"  # no seat or blocks for a remote prefill's KV right now


@dataclass
class Admission:
    placement: Placement
    num_local_hit_tokens: int = 0  # leading prompt tokens already in our prefix cache
    first_block_index: int = 0  # first prompt block the prefill instance must send
    dst_block_ids: list[int] = field(default_factory=list)
    transfer: RecvTransfer | None = None


@dataclass
class PendingImport:
    transfer: RecvTransfer
    abort_requested: bool = False


class DecodeEngineCore(EngineCore):
    def __init__(self, config: EngineConfig, kv_bind_endpoint: str):
        super().__init__(config)
        kv_caches = self.executor.runner.kv_caches
        self.geometry = PoolGeometry.of(kv_caches)
        self.receiver = ZmqKVReceiver(kv_caches, kv_bind_endpoint)
        # Set by the owner of the AsyncEngine: thread-safe "run on the engine thread".
        self.post: Callable[[Callable], None] | None = None
        # Called (on the receiver's thread) with each transfer once it ended and its KV bytes: metrics.
        self.transfer_observer: Callable[[RecvTransfer, int], None] | None = None
        self._imports: dict[str, PendingImport] = {}  # engine thread only

    # ---- admission (engine thread, via AsyncEngine.call) -----------------------------------
    def admit(self, request: Request, remote: bool, local_prefill_threshold: int, transfer_id: str,
              transfer_timeout_s: float) -> Admission:
        if request.req_id in self.scheduler.requests:
            raise DuplicateRequestError(f"request {request.req_id!r} is already in flight on this instance")
        if remote:
            _, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            remote = request.num_tokens - num_hit_tokens >= local_prefill_threshold
        if not remote:
            self.add_request(request)
            return Admission(Placement.LOCAL)
        reservation = self.scheduler.reserve_remote_kv(request)
        if reservation is None:
            return Admission(Placement.FULL)
        first = reservation.num_cached_tokens // self.kv_cache_manager.block_size
        dst = reservation.block_ids[first:]
        try:
            transfer = self.receiver.register(transfer_id, dst, transfer_timeout_s)
        except Exception:
            self.scheduler.fail_remote_kv(request.req_id)
            raise
        self._imports[request.req_id] = PendingImport(transfer)
        req_id = request.req_id
        if self.transfer_observer is not None:
            nbytes = self.geometry.kv_bytes(len(dst))
            transfer.future.add_done_callback(lambda _f: self.transfer_observer(transfer, nbytes))
        transfer.future.add_done_callback(lambda _f: self.post(lambda core: core._import_settled(req_id)))
        return Admission(Placement.REMOTE, reservation.num_cached_tokens, first, dst, transfer)

    # ---- the end of an import (engine thread) ------------------------------------------
    def finish_import(self, req_id: str, first_token_ids: list[int]) -> list[EngineCoreOutput]:
        """The KV landed and the prefill sampled first_token_ids: join the running batch."""
        pending = self._imports.get(req_id)
        if pending is None or pending.abort_requested:  # the abort path settles it
            return []
        del self._imports[req_id]
        return self.scheduler.finish_remote_kv(req_id, first_token_ids)

    def fail_import(self, req_id: str) -> bool:
        """Free the reservation of a failed import (its transfer has ended). False when the
        request was aborted meanwhile: then its abort output goes to its stream instead."""
        pending = self._imports.get(req_id)
        if pending is None or pending.abort_requested:
            return False
        del self._imports[req_id]
        self.scheduler.fail_remote_kv(req_id)
        return True

    def import_to_local(self, req_id: str, request: Request) -> bool:
        """Fallback: free the reservation (its transfer has ended) and prefill here instead."""
        if not self.fail_import(req_id):
            return False
        self.add_request(request)
        return True

    def _import_settled(self, req_id: str) -> list[EngineCoreOutput]:
        pending = self._imports.get(req_id)
        if pending is None or not pending.abort_requested:
            return []  # the request's own handler finishes or fails it
        del self._imports[req_id]
        return self.scheduler.fail_remote_kv(req_id)

    # ---- aborts ------------------------------------------------------------------------
    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        now = []
        for req_id in req_ids:
            pending = self._imports.get(req_id)
            if pending is None or pending.transfer.future.done():
                self._imports.pop(req_id, None)
                now.append(req_id)
            elif not pending.abort_requested:  # freed in _import_settled, once no write can follow
                pending.abort_requested = True
                self.receiver.cancel(pending.transfer.transfer_id, "request aborted on the decode instance")
        return super().abort_requests(now)

    def abort_all(self) -> list[EngineCoreOutput]:
        return self.abort_requests(list(self.scheduler.requests))

    def stats(self) -> dict:
        stats = super().stats()
        stats["num_importing"] = len(self._imports)
        return stats

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()
