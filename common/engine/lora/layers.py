"""The decoder's linears with their adapters' deltas: LoRALinear wraps one (qkv_proj,
o_proj, gate_up_proj, down_proj) and, for each adapter the step's rows use, adds
scaling * (x A^T) B^T to those rows of its output, A and B stacked over the linear's pieces (qkv_proj's
q, k and v; gate_up_proj's gate and up: stack_adapter) so that an adapter costs two
matmuls a linear. Which rows use which adapter is the step's (lora_step), set by the
runner around the forward pass as the attention metadata is.

Under tensor parallelism each rank keeps its share of the stacked matrices (rank_shards):
a column-parallel linear (qkv_proj, gate_up_proj) B's rows of its own output features, all
of A, so the shrink x A^T repeats on every rank and the expand is the rank's own columns; a
row-parallel one (o_proj, down_proj) A's columns of its own input features, all of B, its
delta a partial sum that joins the base's partial output before their one all-reduce.
Pipeline stages stack only their own layers."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.distributed import parallel_state
from common.engine.lora.adapter import LoRAAdapter, module_shapes
from common.engine.models.causal_lm import DECODER_PROJECTIONS
from common.engine.models.parallel_layers import RowParallelLinear, kv_head_partition
from common.engine.models.prepacked_linear import PrepackedLinear, prepacking_available

_local = threading.local()
# A decoder layer's wrapped linears: (its block, its name) -> the PEFT modules it fuses, each
# (name, first output column, number of columns); linear_layouts fills in the sizes.
Layouts = dict[tuple[str, str], list[tuple[str, int, int]]]
# A tensor-parallel rank's share of each wrapped linear's stacked pair: linear name -> (which
# matrix it slices, "A" by columns or "B" by rows; its ranges (first, number) of features).
Shards = dict[str, tuple[str, list[tuple[int, int]]]]


Groups = list[tuple[LoRAAdapter, torch.Tensor | None]]


@contextlib.contextmanager
def lora_step(groups: Groups, num_rows: int, kept_groups: Groups | None = None) -> Iterator[None]:
    """For one forward pass of num_rows rows: each adapter in use with its rows ([n] int64),
    or None where it has every row. kept_groups: the same over the rows the last layer goes
    on with (CausalLM.forward's keep_rows: positions among them), where it keeps fewer."""
    previous = getattr(_local, "step", None)
    _local.step = (groups, num_rows, kept_groups)
    try:
        yield
    finally:
        _local.step = previous


def _current_groups(num_rows: int) -> Groups:
    """The groups for a linear whose input has num_rows rows: the step's, or its kept rows'."""
    step = getattr(_local, "step", None)
    if step is None:
        return []
    groups, num_step_rows, kept_groups = step
    if num_rows == num_step_rows:
        return groups
    if kept_groups is None:
        raise RuntimeError(f"a linear ran on {num_rows} rows of a {num_step_rows}-row step that keeps them all")
    return kept_groups


def linear_layouts(cfg: ModelConfig) -> Layouts:
    out = {module: out_features for module, (_, out_features) in module_shapes(cfg).items()}
    q_out, kv_out, inter = out["q_proj"], out["k_proj"], out["gate_proj"]
    # A fused checkpoint's adapter (Phi-3) targets qkv_proj / gate_up_proj whole: one piece
    # over all the columns, the last of its linear's pieces.
    pieces = [[("q_proj", 0, q_out), ("k_proj", q_out, kv_out), ("v_proj", q_out + kv_out, kv_out),
               ("qkv_proj", 0, out["qkv_proj"])],
              [("o_proj", 0, out["o_proj"])],
              [("gate_proj", 0, inter), ("up_proj", inter, inter), ("gate_up_proj", 0, out["gate_up_proj"])],
              [("down_proj", 0, out["down_proj"])]]
    return dict(zip(DECODER_PROJECTIONS, pieces, strict=True))


def rank_shards(cfg: ModelConfig, tp_rank: int, tp_size: int) -> Shards:
    """What tp_rank keeps of each linear's stacked pair: the features its base linear holds,
    as parallel_layers splits them (query heads evenly, KV heads by kv_head_partition, the
    MLP's intermediate features evenly)."""
    hd = cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    q_per_rank, inter_per_rank = q_out // tp_size, cfg.intermediate_size // tp_size
    kv_start, num_kv_heads = kv_head_partition(cfg.num_key_value_heads, tp_rank, tp_size)
    kv_rows = (kv_start * hd, num_kv_heads * hd)
    return {"qkv_proj": ("B", [(tp_rank * q_per_rank, q_per_rank), (q_out + kv_rows[0], kv_rows[1]),
                               (q_out + kv_out + kv_rows[0], kv_rows[1])]),
            "gate_up_proj": ("B", [(tp_rank * inter_per_rank, inter_per_rank),
                                   (cfg.intermediate_size + tp_rank * inter_per_rank, inter_per_rank)]),
            "o_proj": ("A", [(tp_rank * q_per_rank, q_per_rank)]),
            "down_proj": ("A", [(tp_rank * inter_per_rank, inter_per_rank)])}


def _shard(a: torch.Tensor, b: torch.Tensor, shard: tuple[str, list[tuple[int, int]]]) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    matrix, ranges = shard
    if matrix == "B":
        return a, torch.cat([b[first:first + num] for first, num in ranges])  # [rank's out_features, k * r]
    return torch.cat([a[:, first:first + num] for first, num in ranges], dim=1).contiguous(), b


def stack_adapter(adapter: LoRAAdapter, layouts: Layouts, layer_ids: range, shards: Shards | None = None) -> None:
    """adapter.stacked[(layer, linear name)] = (A [k * r, in_features], B [out_features, k * r])
    over the k pieces of the linear the adapter targets, B block-diagonal, so that
    (x A^T) B^T is every piece's delta in its own columns; for the layers layer_ids (a
    pipeline stage's), each cut to a tensor-parallel rank's shards where given."""
    for layer in layer_ids:
        for (_, linear_name), pieces in layouts.items():
            targeted = [(first, size, adapter.weights[(layer, module)]) for module, first, size in pieces
                        if (layer, module) in adapter.weights]
            if not targeted:
                continue
            a_cat = torch.cat([a for _, _, (a, _) in targeted])  # [k * r, in_features]
            out_features = pieces[-1][1] + pieces[-1][2]
            b_stacked = a_cat.new_zeros(out_features, a_cat.shape[0])  # [out_features, k * r]
            for i, (first, size, (_, b)) in enumerate(targeted):
                b_stacked[first:first + size, i * adapter.rank:(i + 1) * adapter.rank] = b
            if shards is not None:
                a_cat, b_stacked = _shard(a_cat, b_stacked, shards[linear_name])
            adapter.stacked[(layer, linear_name)] = (a_cat, b_stacked)
            if _packs(a_cat):
                adapter.packed[(layer, linear_name)] = (PrepackedLinear(a_cat, None), PrepackedLinear(b_stacked, None))


def _packs(weight: torch.Tensor) -> bool:
    """Whether an adapter's matrices run as packed linears: bf16 on the CPU, where a decode
    row's two small matmuls take ~7 us packed against ~29 us through torch (~1.5x at 8-64
    rows; fp32 gains little: `docs/benchmarks.md`, LoRA)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and prepacking_available(weight.dtype)


# From this many rows of one adapter (a prompt's chunk) the expand adds into y itself
# (addmm_: one pass over y instead of a delta written, read and added): at 512-2,048 rows of
# SmolLM2's shapes, bf16, 0.6-0.8x the time of the packed expand and add; below, slower.
ADD_IN_MATMUL_ROWS = 256


def add_lora_deltas(y: torch.Tensor, x: torch.Tensor, layer_idx: int, linear_name: str) -> None:
    """y [num_tokens, out_features] += each row's adapter's delta, x [num_tokens, in_features]
    the linear's input; rows of no adapter, and a step of none, cost nothing."""
    for adapter, rows in _current_groups(x.shape[0]):
        pair = adapter.stacked.get((layer_idx, linear_name))
        if pair is None:  # not one of this adapter's targets
            continue
        x_rows = x if rows is None else x.index_select(0, rows)  # [num_rows, in_features]
        packed = adapter.packed.get((layer_idx, linear_name))
        a, b = pair  # [k * r, in_features], [out_features, k * r]
        if rows is None and x.shape[0] >= ADD_IN_MATMUL_ROWS:
            shrunk = packed[0](x) if packed is not None else x @ a.t()  # [num_tokens, k * r]
            y.addmm_(shrunk, b.t(), alpha=adapter.scaling)  # the expand adds into y as it goes
            continue
        if packed is not None:
            rows_delta = packed[1](packed[0](x_rows))  # [num_rows, out_features]
        else:
            rows_delta = (x_rows @ a.t()) @ b.t()  # [num_rows, out_features]
        if rows is None:
            y.add_(rows_delta, alpha=adapter.scaling)
        else:
            y.index_add_(0, rows, rows_delta, alpha=adapter.scaling)


# The deltas as one op a compiled graph calls without tracing into it (which adapters a
# step's rows use is the step's, read at run time, as attention reads its metadata): so an
# engine with adapters keeps its compiled forward. It adds to the base linear's output in
# place (a declared mutation, which the compiler keeps in place: that output has no other
# use), so a step naming no adapter pays no zeros and no add. Low-level registration, as
# pdserve::paged_attention's (models/attention.py).
_LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
_LIBRARY.define("add_lora_deltas(Tensor(a!) y, Tensor x, Tensor layer_idx, str linear_name) -> ()")
_LIBRARY.impl("add_lora_deltas", lambda y, x, layer_idx, linear_name: add_lora_deltas(
    y, x, int(layer_idx), linear_name), "CompositeExplicitAutograd")
torch.library.register_fake("pdserve::add_lora_deltas", lambda y, x, layer_idx, linear_name: None, lib=_LIBRARY)


class LoRALinear(nn.Module):
    """base(x) plus each adapter's delta on its rows."""

    def __init__(self, base: nn.Module, layer_idx: int, linear_name: str):
        super().__init__()
        self.base = base
        self.linear_name = linear_name
        # A tensor, not an int: one compiled decoder layer serves every layer (no guard on it).
        self.layer_idx = torch.tensor(layer_idx, device="cpu")
        # A row-parallel base's output is its ranks' partial sums all-reduced: the delta of
        # this rank's input features is a partial sum too and joins before that reduce.
        self.sums_ranks = isinstance(base, RowParallelLinear) and base.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [num_tokens, in_features]
        if self.sums_ranks:
            y = self.base.partial(x)  # [num_tokens, out_features], this rank's share
            torch.ops.pdserve.add_lora_deltas(y, x, self.layer_idx, self.linear_name)
            return parallel_state.tp_all_reduce(y)
        y = self.base(x)  # [num_tokens, out_features]
        torch.ops.pdserve.add_lora_deltas(y, x, self.layer_idx, self.linear_name)
        return y


def base_linear(linear: nn.Module) -> nn.Module:
    """The linear a LoRALinear wraps (whose weights the native decode loop reads, adding the
    deltas itself), else linear."""
    return linear.base if isinstance(linear, LoRALinear) else linear


def wrap_linears(model: nn.Module, layouts: Layouts) -> int:
    """Every decoder layer's linears (a pipeline stage's: model.layers) wrapped in LoRALinear;
    the number wrapped."""
    num_wrapped = 0
    for offset, layer in enumerate(model.layers):
        for block_name, linear_name in layouts:
            block = getattr(layer, block_name)
            setattr(block, linear_name, LoRALinear(getattr(block, linear_name), model.start_layer + offset,
                                                   linear_name))
            num_wrapped += 1
    return num_wrapped
