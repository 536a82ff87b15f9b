"""Tensor-parallel layers (vLLM's): each rank holds a slice of a weight and loads only it.

Column-parallel layers (q/k/v, gate/up) split their output features, so each rank
computes its own heads or MLP columns with no communication; row-parallel layers
(o_proj, down_proj) split their input features and sum the partial outputs with an
all-reduce over the TP group. The vocabulary is split in contiguous ranges, padded up to
a multiple of tp_size; the padded rows are zero and cut from the logits.

At tp_size 1 every layer is a plain F.linear / F.embedding: no masks, no collectives.
Layers take tp_rank / tp_size from parallel_state unless given (tests shard by hand).
`load_weight(param_name, full_tensor, shard_id)` copies this rank's rows or columns of a
checkpoint tensor; shard_id picks the piece of a packed weight (q=0, k=1, v=2; gate=0,
up=1), None a checkpoint tensor that is already packed (Phi-3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.engine.distributed import parallel_state


def _tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    if tp_size is None:
        return parallel_state.get_tp_rank(), parallel_state.get_tp_size()
    return tp_rank or 0, tp_size


def kv_head_partition(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) of tp_rank. With more ranks than KV heads each
    head is replicated on tp_size // num_kv_heads adjacent ranks (ModelConfig checks that
    this divides)."""
    if tp_size >= num_kv_heads:
        return tp_rank * num_kv_heads // tp_size, 1
    per_rank = num_kv_heads // tp_size
    return tp_rank * per_rank, per_rank


def vocab_partition(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """(first token id, rows per rank): rank r owns ids [first, first + rows); the last
    rank's rows past vocab_size are padding."""
    rows_per_rank = -(-vocab_size // tp_size)
    return tp_rank * rows_per_rank, rows_per_rank


def _copy_rows(param: torch.Tensor, dst_row: int, loaded: torch.Tensor, src_row: int, num_rows: int,
               expected_shape: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected_shape:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {expected_shape}")
    param.data.narrow(0, dst_row, num_rows).copy_(loaded.narrow(0, src_row, num_rows))


class QKVParallelLinear(nn.Linear):
    """q, k and v in one column-parallel matmul: this rank's query heads, then its KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool, tp_rank: int | None = None, tp_size: int | None = None):
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = total_num_heads // self.tp_size
        self.kv_head_start, self.num_kv_heads = kv_head_partition(total_num_kv_heads, self.tp_rank, self.tp_size)
        super().__init__(hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias=bias)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        param = getattr(self, param_name)
        hd, trailing = self.head_dim, tuple(param.shape[1:])
        q_rows, kv_rows = self.total_num_heads * hd, self.total_num_kv_heads * hd
        if shard_id is None:  # the checkpoint packs q, k, v already
            if loaded.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"shape {tuple(loaded.shape)}, expected {(q_rows + 2 * kv_rows, *trailing)}")
            for i, piece in enumerate(loaded.split([q_rows, kv_rows, kv_rows])):
                self.load_weight(param_name, piece, i)
            return
        if shard_id == 0:
            num_rows = self.num_heads * hd
            _copy_rows(param, 0, loaded, self.tp_rank * num_rows, num_rows, (q_rows, *trailing))
        else:
            num_rows = self.num_kv_heads * hd
            dst_row = self.num_heads * hd + (shard_id - 1) * num_rows
            _copy_rows(param, dst_row, loaded, self.kv_head_start * hd, num_rows, (kv_rows, *trailing))


class MergedColumnParallelLinear(nn.Linear):
    """Several column-parallel projections of one input in one matmul (gate and up): this
    rank's slice of each, one after another."""

    def __init__(self, input_size: int, output_size: int, num_pieces: int = 2,
                 tp_rank: int | None = None, tp_size: int | None = None):
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.total_output_size = output_size  # of one piece
        self.output_size_per_rank = output_size // self.tp_size
        self.num_pieces = num_pieces
        super().__init__(input_size, num_pieces * self.output_size_per_rank, bias=False)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        param = getattr(self, param_name)
        if shard_id is None:  # the checkpoint packs the pieces already
            for i, piece in enumerate(loaded.chunk(self.num_pieces)):
                self.load_weight(param_name, piece, i)
            return
        num_rows = self.output_size_per_rank
        _copy_rows(param, shard_id * num_rows, loaded, self.tp_rank * num_rows, num_rows,
                   (self.total_output_size, *param.shape[1:]))


class RowParallelLinear(nn.Linear):
    """y = x W^T with W's input features split: each rank's partial sum, all-reduced."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int | None = None, tp_size: int | None = None):
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.total_input_size = input_size
        super().__init__(input_size // self.tp_size, output_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        return parallel_state.tp_all_reduce(y) if self.tp_size > 1 else y

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, this rank's input features] -> this rank's share of the sum
        [num_tokens, output_size] (a LoRA delta joins it before the all-reduce)."""
        return F.linear(x, self.weight)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        expected = (self.out_features, self.total_input_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {expected}")
        num_cols = self.in_features
        self.weight.data.copy_(loaded.narrow(1, self.tp_rank * num_cols, num_cols))


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split by token id: a rank looks up the ids it owns, zeros the rest,
    and the all-reduce assembles every token's row."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int | None = None, tp_size: int | None = None):
        self.tp_rank, self.tp_size = _tp(tp_rank, tp_size)
        self.vocab_size = vocab_size
        self.vocab_start, rows_per_rank = vocab_partition(vocab_size, self.tp_rank, self.tp_size)
        self.num_real_rows = max(0, min(rows_per_rank, vocab_size - self.vocab_start))
        super().__init__(rows_per_rank, hidden_size)

    def reset_parameters(self) -> None:
        # Models are built on the meta device and then loaded: a random init there has
        # nothing to fill, and the meta normal_ imports torch._dynamo (seconds of start-up).
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        x = F.embedding(local_ids.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return parallel_state.tp_all_reduce(x)

    def load_weight(self, param_name: str, loaded: torch.Tensor, shard_id: int | None) -> None:
        expected = (self.vocab_size, self.embedding_dim)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {expected}")
        self.weight.data.zero_()  # padding rows stay zero
        self.weight.data.narrow(0, 0, self.num_real_rows).copy_(loaded.narrow(0, self.vocab_start, self.num_real_rows))


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split by vocabulary like the embedding (and loadable from the
    embedding's checkpoint tensor when the two are tied); `parallel_logits` applies it."""


def parallel_logits(hidden: torch.Tensor, head_weight: torch.Tensor, vocab_size: int, tp_size: int) -> torch.Tensor:
    """hidden [num_rows, hidden_size], this rank's head rows [rows_per_rank, hidden_size]
    -> logits [num_rows, vocab_size]: every rank's slice gathered, padding cut."""
    logits = F.linear(hidden, head_weight)  # [num_rows, rows_per_rank]
    if tp_size == 1:
        return logits
    return parallel_state.tp_all_gather(logits, dim=-1)[:, :vocab_size]
