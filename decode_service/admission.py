"""Decode admission and the end of an import, as functions run on the engine thread
(through AsyncEngine.call) over the one engine every role runs.

Admission decides, atomically, between a local prefill (the plain engine path) and a
remote one: reserve the prompt's blocks with the request's kv_transfer_params, so the
engine's KV connector expects the transfer before the prefill instance is called.
Blocks a transfer may still write into are never freed early: the scheduler frees an
aborted import's reservation only once its receive is reported ended.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.engine.engine_core import EngineCore
from common.engine.outputs import EngineCoreOutput
from common.engine.request import Request
from common.service.errors import DuplicateRequestError


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
    transfer_id: str = ""


def admit(core: EngineCore, request: Request, remote: bool, local_prefill_threshold: int, transfer_id: str,
          transfer_timeout_s: float) -> Admission:
    if request.req_id in core.scheduler.requests:
        raise DuplicateRequestError(f"request {request.req_id!r} is already in flight on this instance")
    if remote:
        _, num_hit_tokens = core.kv_cache_manager.get_computed_blocks(request)
        remote = request.num_tokens - num_hit_tokens >= local_prefill_threshold
    if not remote:
        core.add_request(request)
        return Admission(Placement.LOCAL)
    request.kv_transfer_params = {"transfer_id": transfer_id, "timeout_s": transfer_timeout_s}
    reservation = core.reserve_remote_kv(request)
    if reservation is None:
        request.kv_transfer_params = None
        return Admission(Placement.FULL)
    first = reservation.num_cached_tokens // core.kv_cache_manager.block_size
    return Admission(Placement.REMOTE, reservation.num_cached_tokens, first, reservation.block_ids[first:],
                     transfer_id)


def finish_import(core: EngineCore, req_id: str, first_token_ids: list[int]) -> list[EngineCoreOutput]:
    """The KV landed and the prefill sampled first_token_ids: join the running batch."""
    return core.scheduler.finish_remote_kv(req_id, first_token_ids)


def cancel_import(core: EngineCore, req_id: str, reason: str) -> None:
    """Stop the import's transfer; its end is still reported, the reservation kept till then."""
    core.scheduler.cancel_remote_kv(req_id, reason)


def fail_import(core: EngineCore, req_id: str) -> bool:
    """Free the reservation of a failed import (its transfer has ended). False when the
    request was aborted meanwhile: then its abort output goes to its stream instead."""
    scheduler = core.scheduler
    if req_id not in scheduler.waiting_for_remote_kv or scheduler.remote_kv_aborting(req_id):
        return False
    scheduler.fail_remote_kv(req_id)
    return True


def import_to_local(core: EngineCore, req_id: str, request: Request) -> bool:
    """Fallback: free the reservation (its transfer has ended) and prefill here instead."""
    if not fail_import(core, req_id):
        return False
    core.add_request(request)
    return True
