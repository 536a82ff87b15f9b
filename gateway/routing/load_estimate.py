"""One instance's load as placement sees it: its last heartbeat plus what this
gateway has charged and released there since.

Between two heartbeats the gateway adds what it has dispatched itself, so a burst
of requests does not all pick the instance that looked idle at the last heartbeat,
and takes off what it has seen finish, so the instance that has just served a
request does not look busy with it until the next heartbeat (with requests about
as long as the heartbeat interval, that stale load alone moved tenants off the
instance caching their prefix). A heartbeat replaces the whole estimate with the
instance's own numbers: it already counts what was dispatched before it, so a
charge made before it and released after it is taken off the reported numbers,
once, and nothing charged before it is counted again.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from common.service.registration import InstanceLoad


@dataclass(frozen=True)
class LoadDelta:
    """An amount of load: positive when charged at dispatch, negated when released."""

    num_requests: int = 0
    num_prefill_tokens: int = 0  # prompt tokens still to compute (net of cached blocks)
    num_blocks: int = 0  # KV blocks taken

    def __add__(self, other: LoadDelta) -> LoadDelta:
        return LoadDelta(self.num_requests + other.num_requests,
                         self.num_prefill_tokens + other.num_prefill_tokens,
                         self.num_blocks + other.num_blocks)

    def __neg__(self) -> LoadDelta:
        return LoadDelta(-self.num_requests, -self.num_prefill_tokens, -self.num_blocks)


@dataclass
class LoadEstimate:
    reported: InstanceLoad  # the last heartbeat's numbers
    # Charged minus released since `reported`; negative once requests the heartbeat
    # counted have been seen finishing.
    net_since_report: LoadDelta = field(default_factory=LoadDelta)

    def replace_report(self, load: InstanceLoad) -> None:
        self.reported = replace(load)
        self.net_since_report = LoadDelta()

    def add(self, delta: LoadDelta) -> None:
        self.net_since_report = self.net_since_report + delta

    # Clamped: a request that finished just before the heartbeat's snapshot is taken
    # off a report that no longer counts it.
    @property
    def num_requests(self) -> int:
        return max(0, self.reported.num_running_requests + self.reported.num_waiting_requests
                   + self.net_since_report.num_requests)

    @property
    def queued_prefill_tokens(self) -> int:
        return max(0, self.reported.num_queued_prefill_tokens + self.net_since_report.num_prefill_tokens)

    @property
    def free_blocks(self) -> int:
        free = self.reported.num_free_blocks - self.net_since_report.num_blocks
        return max(0, min(free, self.reported.num_total_blocks or free))  # total unknown (0): no cap
