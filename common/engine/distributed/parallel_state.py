"""Tensor- and pipeline-parallel process groups of this process, and the collectives over them.

Rank layout (vLLM's): rank = pp_rank * tp_size + tp_rank, so the ranks of one pipeline
stage are adjacent and form its TP group. A worker calls
`torch.distributed.init_process_group(...)`, then `initialize_model_parallel(tp, pp)`,
then builds its ModelRunner; the model's layers read their shard from here.

Without initialize_model_parallel every getter answers for one process (rank 0 of 1)
and every collective is the identity, so single-process code never touches
torch.distributed.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ModelParallelState:
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    tp_group: object | None  # a torch.distributed ProcessGroup (None: one rank)
    tp_group_ranks: tuple[int, ...]  # global ranks of this stage's TP group, by tp_rank

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank


_SINGLE = ModelParallelState(tp_size=1, pp_size=1, tp_rank=0, pp_rank=0, tp_group=None, tp_group_ranks=(0,))
_state: ModelParallelState = _SINGLE


def initialize_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Build the TP groups (one per stage); needs an initialised default process group of
    tensor_parallel_size * pipeline_parallel_size ranks. Every rank must call it."""
    global _state
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group first")
    world_size = dist.get_world_size()
    if world_size != tensor_parallel_size * pipeline_parallel_size:
        raise ValueError(f"world size {world_size} != tensor_parallel_size ({tensor_parallel_size}) x "
                         f"pipeline_parallel_size ({pipeline_parallel_size})")
    rank = dist.get_rank()
    pp_rank, tp_rank = divmod(rank, tensor_parallel_size)
    my_group, my_ranks = None, (rank,)
    # new_group is collective over the whole world: every rank creates every group, in order.
    for stage in range(pipeline_parallel_size):
        ranks = tuple(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
        group = dist.new_group(list(ranks)) if tensor_parallel_size > 1 else None
        if stage == pp_rank:
            my_group, my_ranks = group, ranks
    _state = ModelParallelState(tp_size=tensor_parallel_size, pp_size=pipeline_parallel_size, tp_rank=tp_rank,
                                pp_rank=pp_rank, tp_group=my_group, tp_group_ranks=my_ranks)


def destroy_model_parallel() -> None:
    """Forget the groups (the default process group stays; the caller destroys it)."""
    global _state
    if _state.tp_group is not None:
        dist.destroy_process_group(_state.tp_group)
    _state = _SINGLE


@contextlib.contextmanager
def one_rank_view() -> Iterator[None]:
    """Within it the getters answer for one process (rank 0 of 1): a model built here is
    whole (every layer, head and vocabulary row) and its layers run no collectives, even
    in a rank of a parallel run (a draft model on the rank that samples)."""
    global _state
    saved, _state = _state, _SINGLE
    try:
        yield
    finally:
        _state = saved


def model_parallel_is_initialized() -> bool:
    return _state is not _SINGLE


def get_state() -> ModelParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def get_pp_rank() -> int:
    return _state.pp_rank


def get_pp_size() -> int:
    return _state.pp_size


def is_first_stage() -> bool:
    return _state.pp_rank == 0


def is_last_stage() -> bool:
    return _state.pp_rank == _state.pp_size - 1


def pipeline_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage pp_rank runs: vLLM's even split, where the remainder
    goes one layer each to the stages before the last (from the second-to-last backwards),
    since the last stage also runs the final norm and the LM head."""
    if num_layers < pp_size:
        raise ValueError(f"Total number of hidden layers ({num_layers}) must be at least the pipeline "
                         f"parallel size ({pp_size}).")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        sizes[-i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP group (in place); the identity at one rank."""
    if _state.tp_size == 1:
        return x
    dist.all_reduce(x, group=_state.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every TP rank's x along dim, in tp_rank order; the identity at one rank."""
    if _state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x, group=_state.tp_group)
    return torch.cat(parts, dim=dim)


def tp_broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """x as TP rank 0 of this stage holds it, on every rank of the group (in place); the
    identity at one rank."""
    if _state.tp_size == 1:
        return x
    dist.broadcast(x, src=_state.tp_group_ranks[0], group=_state.tp_group)
    return x


def _peer_rank(stage_offset: int) -> int:
    """The global rank with this rank's tp_rank, stage_offset stages away."""
    return (_state.pp_rank + stage_offset) * _state.tp_size + _state.tp_rank


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send x to the same tp_rank of the next stage (blocking)."""
    if is_last_stage():
        raise RuntimeError("the last pipeline stage has no next stage")
    dist.send(x.contiguous(), dst=_peer_rank(1))


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive what the same tp_rank of the previous stage sent (blocking)."""
    if is_first_stage():
        raise RuntimeError("the first pipeline stage has no previous stage")
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=_peer_rank(-1))
    return x
