"""The runner's adapters: loaded on a request's first use (EngineCore asks before it
queues the request, so a bad adapter fails it with nothing scheduled), at most max_loras
at once (EngineCore evicts one no live request uses), and the rows of each step that use
each (lora_step). Under tensor or pipeline parallelism every rank holds the same adapters,
each its share (layers.rank_shards) of its stage's layers; the engine names them by plain
(name, path) so that the calls reach every rank's manager alike."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from common.engine.config import ModelConfig
from common.engine.distributed import parallel_state
from common.engine.lora.adapter import LoRAAdapter, load_adapter
from common.engine.lora.layers import linear_layouts, lora_step, rank_shards, stack_adapter, wrap_linears
from common.engine.outputs import ScheduledRequest


class LoRAManager:
    def __init__(self, model: nn.Module, cfg: ModelConfig, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.cfg = cfg
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        self.adapters: dict[str, LoRAAdapter] = {}
        self.layouts = linear_layouts(cfg)
        self.layer_ids = range(model.start_layer, model.end_layer)  # this pipeline stage's
        tp_size = parallel_state.get_tp_size()
        self.shards = rank_shards(cfg, parallel_state.get_tp_rank(), tp_size) if tp_size > 1 else None
        wrap_linears(model, self.layouts)
        self._register_native: Callable[[LoRAAdapter], int] | None = None

    def register_with(self, register: Callable[[LoRAAdapter], int]) -> None:
        """Register every adapter, those held now and those added later, with the native
        decode loop (register returns its id there), which then takes their steps too."""
        self._register_native = register
        for adapter in self.adapters.values():
            adapter.native_id = register(adapter)

    def add(self, lora_name: str, lora_path: str) -> None:
        """Load the adapter (EngineCore asks only for one it does not hold); ValueError for one
        this model cannot serve."""
        adapter = self.check(lora_name, lora_path)
        stack_adapter(adapter, self.layouts, self.layer_ids, self.shards)
        adapter.weights.clear()  # what the linears read is the stacked form
        if self._register_native is not None:
            adapter.native_id = self._register_native(adapter)
        self.adapters[lora_name] = adapter

    def check(self, lora_name: str, lora_path: str) -> LoRAAdapter:
        """The adapter as loaded, not held; ValueError for one this model cannot serve."""
        return load_adapter(lora_name, lora_path, self.cfg, self.max_lora_rank, self.dtype, self.device)

    def remove(self, lora_name: str) -> None:
        self.adapters.pop(lora_name, None)

    def native_ids(self, ordered: Sequence[ScheduledRequest]) -> torch.Tensor | None:
        """Each row's adapter id with the native decode loop ([num_rows] int64, -1: none) for a
        step whose rows are `ordered`'s tokens in order; None where no row names an adapter."""
        if not any(req.lora_name for req in ordered):
            return None
        ids = []
        for req in ordered:
            native_id = -1 if req.lora_name is None else self.adapters[req.lora_name].native_id
            ids += [native_id] * len(req.token_ids)
        return torch.tensor(ids, dtype=torch.int64)

    def all_native(self, ordered: Sequence[ScheduledRequest]) -> bool:
        """Whether every adapter the step names is registered with the native decode loop."""
        return all(self.adapters[req.lora_name].native_id is not None for req in ordered if req.lora_name)

    @contextlib.contextmanager
    def step(self, ordered: Sequence[ScheduledRequest], kept_rows: list[int] | None = None) -> Iterator[None]:
        """The forward pass of a step whose rows are `ordered`'s tokens, in order; kept_rows:
        the rows its last layer goes on with (CausalLM.forward's keep_rows), if fewer."""
        row_names: list[str | None] = []  # each row's adapter
        for req in ordered:
            row_names += [req.lora_name] * len(req.token_ids)
        groups = self._groups(row_names)
        kept_groups = None
        if kept_rows is not None and len(kept_rows) != len(row_names):
            kept_groups = self._groups([row_names[row] for row in kept_rows])
        with lora_step(groups, len(row_names), kept_groups):
            yield

    def _groups(self, row_names: list[str | None]) -> list[tuple[LoRAAdapter, torch.Tensor | None]]:
        """Each adapter the rows name, with its rows; None for an adapter with every row (the
        common case: one adapter)."""
        rows: dict[str, list[int]] = {}
        for row, name in enumerate(row_names):
            if name is not None:
                rows.setdefault(name, []).append(row)
        return [(self.adapters[name], None if len(ids) == len(row_names) else
                 torch.tensor(ids, dtype=torch.int64, device=self.device)) for name, ids in rows.items()]
