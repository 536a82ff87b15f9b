"""KV export, prefill side: check a decode instance's KV target against the prompt and
our pool before any work is done, and turn it into the request's kv_transfer_params
for the engine's KV connector (which ships the KV when the prompt's last chunk runs)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from common.engine.kv_connector.head_mapping import KVLayoutMismatchError, check_pool_pairing
from common.service.errors import ServiceError, invalid
from kv_transfer import KVTarget, PoolGeometry
from kv_transfer.base import check_transfer_id
from kv_transfer.zmq_common import check_endpoint
from prefill_service.api import KvTargetSpec


class TargetMismatchError(ValueError):
    """The decode pool's geometry differs from ours (layers, dtype), or its KV heads cannot
    be mapped onto ours (block shape, tensor-parallel layout)."""


@dataclass(eq=False)
class ExportTarget:
    """Where one request's KV goes: the receiver's target, and the first prompt block
    it wants (earlier blocks are already in the decode instance's prefix cache)."""

    target: KVTarget
    first_block_index: int
    # Every decode rank's endpoint, in rank order (the first is target.endpoint).
    rank_endpoints: list[str] | None = None
    # Seconds the send may take from its start (target.deadline still bounds it); None: no own limit.
    transfer_timeout_s: float | None = None

    def kv_transfer_params(self) -> dict:
        target = self.target.to_dict()
        if self.rank_endpoints and len(self.rank_endpoints) > 1:
            target["rank_endpoints"] = list(self.rank_endpoints)
        params = {"target": target, "first_block_index": self.first_block_index}
        if self.transfer_timeout_s is not None:
            params["transfer_timeout_s"] = self.transfer_timeout_s
        return params


def make_export_target(*, endpoint: str, transfer_id: str, dst_block_ids: list[int], first_block_index: int,
                       num_layers: int, dtype: str, block_shape: list[int], timeout_s: float,
                       num_prompt_tokens: int, geometry: PoolGeometry, rank_endpoints: list[str] | None = None,
                       num_kv_heads: int = 0, tensor_parallel_size: int = 1,
                       transfer_timeout_s: float | None = None) -> ExportTarget:
    """Check a KV target against the prompt and our pool before any work is done.

    rank_endpoints: one per decode rank when the decode instance runs tensor parallel
    (block_shape is then each rank's); num_kv_heads and tensor_parallel_size are this
    model's and this instance's, to map one layout onto the other."""
    check_transfer_id(transfer_id)
    rank_endpoints = list(rank_endpoints) if rank_endpoints else [endpoint]
    if rank_endpoints[0] != endpoint:
        raise ValueError(f"kv_target: rank 0's endpoint {rank_endpoints[0]!r} is not kv_endpoint {endpoint!r}")
    for rank_endpoint in rank_endpoints:
        check_endpoint(rank_endpoint)
    block_size = geometry.block_shape[0]
    num_prompt_blocks = -(-num_prompt_tokens // block_size)
    if not 0 <= first_block_index < num_prompt_blocks:
        raise ValueError(f"kv_target.first_block_index {first_block_index} is outside the prompt's "
                         f"{num_prompt_blocks} blocks")
    if len(dst_block_ids) != num_prompt_blocks - first_block_index:
        raise ValueError(f"kv_target has {len(dst_block_ids)} destination blocks; a prompt of "
                         f"{num_prompt_tokens} tokens from block {first_block_index} on needs "
                         f"{num_prompt_blocks - first_block_index} (block size {block_size})")
    same_split = len(rank_endpoints) == tensor_parallel_size
    if (num_layers, dtype) != (geometry.num_layers, geometry.dtype) or (
            same_split and tuple(block_shape) != geometry.block_shape):
        raise TargetMismatchError(
            f"decode pool has {num_layers} layers of {dtype} blocks {list(block_shape)}, this prefill pool "
            f"{geometry.num_layers} layers of {geometry.dtype} blocks {list(geometry.block_shape)}")
    if not same_split:
        block_size, _, head_dim = geometry.block_shape
        try:
            if not num_kv_heads:
                raise KVLayoutMismatchError(f"{len(rank_endpoints)} decode ranks, {tensor_parallel_size} prefill "
                                            f"ranks, and this prefill pool's number of KV heads is unknown")
            check_pool_pairing(num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                               src_tp_size=tensor_parallel_size, dst_tp_size=len(rank_endpoints),
                               dst_block_shape=block_shape)
        except KVLayoutMismatchError as e:
            raise TargetMismatchError(str(e)) from None
    if not timeout_s > 0:
        raise ValueError("kv_target timeout must be > 0")
    if transfer_timeout_s is not None and not transfer_timeout_s > 0:
        raise ValueError("kv_target transfer timeout must be > 0")
    target = KVTarget(transfer_id=transfer_id, endpoint=endpoint, dst_block_ids=tuple(dst_block_ids),
                      num_layers=num_layers, dtype=dtype, block_shape=tuple(block_shape),
                      deadline=time.time() + timeout_s)
    return ExportTarget(target, first_block_index, rank_endpoints, transfer_timeout_s)


def export_target(spec: KvTargetSpec, num_prompt_tokens: int, geometry: PoolGeometry,
                  default_timeout_s: float, kv_connector_info: dict) -> ExportTarget:
    """The checked ExportTarget of a Prefill call's kv_target, or the ServiceError to answer.
    kv_connector_info: ours, with the hash and description of what our KV means."""
    if spec.kv_layout_hash != kv_connector_info["kv_layout_hash"]:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"KV layout mismatch: the decode instance's KV layout hash is "
                           f"{spec.kv_layout_hash or 'missing'}, this prefill instance's "
                           f"{kv_connector_info['kv_layout_hash']} ({kv_connector_info['kv_layout']}); both must "
                           f"serve the same model config with the same dtype and block size")
    try:
        return make_export_target(
            endpoint=spec.kv_endpoint, transfer_id=spec.transfer_id, dst_block_ids=spec.dst_block_ids,
            first_block_index=spec.first_block_index, num_layers=spec.num_layers, dtype=spec.dtype,
            block_shape=spec.block_shape,
            timeout_s=default_timeout_s if spec.timeout_s is None else spec.timeout_s,
            num_prompt_tokens=num_prompt_tokens, geometry=geometry, rank_endpoints=spec.rank_kv_endpoints,
            num_kv_heads=kv_connector_info.get("num_kv_heads", 0),
            tensor_parallel_size=kv_connector_info.get("tensor_parallel_size", 1),
            transfer_timeout_s=spec.transfer_timeout_s)
    except TargetMismatchError as e:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
    except ValueError as e:
        raise invalid(f"bad kv_target: {e}") from None

