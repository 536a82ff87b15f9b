"""Plain data that crosses the connector seam: built by the scheduler half each step,
carried in SchedulerOutput to the worker half, whose results come back in RunnerOutput.
Lists, dicts, str, int and float only, so a step can be msgpack'd to a worker process.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVSendSpec:
    """Ship req_id's prompt KV: src_block_ids of this pool into the target's blocks."""

    req_id: str
    src_block_ids: list[int]
    target: dict[str, Any]  # kv_transfer.KVTarget.to_dict()


@dataclass
class KVRecvSpec:
    """Expect req_id's prompt KV from outside into dst_block_ids within timeout_s."""

    req_id: str
    transfer_id: str
    dst_block_ids: list[int]
    timeout_s: float


@dataclass
class KVConnectorMetadata:
    sends: list[KVSendSpec] = field(default_factory=list)  # start in this step, after its forward
    recvs: list[KVRecvSpec] = field(default_factory=list)  # register before this step runs
    # Stop these requests' open transfers; each still ends through get_finished.
    abort_req_ids: list[str] = field(default_factory=list)
    abort_reason: dict[str, str] = field(default_factory=dict)  # req_id -> why, for the peer

    @property
    def is_empty(self) -> bool:
        return not (self.sends or self.recvs or self.abort_req_ids)


@dataclass
class KVTransferOutcome:
    """How one transfer ended. Once reported, the transport no longer touches its blocks."""

    req_id: str
    transfer_id: str
    direction: str  # "send" | "recv"
    state: str  # kv_transfer.TransferState value: "done", "failed" or "expired"
    reason: str = ""
    num_bytes: int = 0  # K and V bytes the transfer moves when complete
    # time.monotonic() stamps for metrics: started, first KV message landed (receives), ended.
    started_at: float = 0.0
    first_byte_at: float | None = None
    ended_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.state == "done"

    @property
    def received_any(self) -> bool:
        """A receive into which at least one KV message was written."""
        return self.first_byte_at is not None
