"""Shared pieces of the torch.distributed connector: rendezvous keys, group creation, framing.

Rendezvous is our own: the receiver hosts a TCPStore on its endpoint
(`gloo://host:port` or `nccl://host:port`). A sender takes the next peer number k
(`store.add`), announces itself under `kvt/peer/{k}`, and both build a two-rank group
(receiver rank 0, sender rank 1) on `PrefixStore("kvt/{k}/")`, independent of any
global `init_process_group`. Data flows sender -> receiver with point-to-point
send/recv; the receiver's acks go back through the store (`kvt/ack/{k}/{i}`), which a
sender polls. A sender sends a keepalive (preamble [0, 0]) on every idle pair each
KEEPALIVE_S, so a receiver's idle wait for the next message is bounded by
IDLE_TIMEOUT_S and its pair threads notice close() promptly; no receive is unbounded.

Message framing on the group: int64[2] (header bytes, frame count), int64[frame count]
(frame sizes), uint8[header bytes] (the msgpack header of protocol.py), then the frames.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
TAG = 0
KEEPALIVE_S = 0.5        # sender: keepalive on a pair idle this long
IDLE_TIMEOUT_S = 5.0     # receiver: a pair silent this long (no keepalive either) is dead
PAIR_IDLE_DROP_S = 60.0  # sender: close a pair that carried no transfer this long


def peer_key(k: int) -> str:
    return f"kvt/peer/{k}"


def ack_key(k: int, i: int) -> str:
    return f"kvt/ack/{k}/{i}"


def parse_endpoint(endpoint: str) -> tuple[str, str, int]:
    backend, sep, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if not sep or backend not in BACKENDS or not host or not port.isdigit():
        raise ValueError(f"torch.distributed KV endpoint must be gloo://host:port or nccl://host:port, "
                         f"got {endpoint!r}")
    return backend, host, int(port)


def make_group(store: dist.Store, k: int, rank: int, backend: str, host: str, timeout_s: float):
    """A private two-rank process group for pair k (blocks until both ranks joined, bounded)."""
    prefixed = dist.PrefixStore(f"kvt/{k}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)


def comm_device(backend: str, pool_device: torch.device) -> torch.device:
    """NCCL moves only device tensors, so control tensors live on the pool's GPU there."""
    return pool_device if backend == "nccl" else torch.device("cpu")


def wait(work, timeout_s: float) -> None:
    # A timed-out Gloo op breaks its pair; callers then drop the whole pair.
    work.wait(timedelta(seconds=max(timeout_s, 0.001)))
