"""Decode-only steps replayed from CUDA graphs, one graph per batch-size bucket.

On a GPU a decode step of a small model is bound by launching kernels (a dozen per layer,
each behind Python and inductor's wrapper code), not by the GPU's work; a captured graph
issues the whole forward pass in one launch. Each bucket's graph is captured over static
buffers, so a step copies its inputs into them and reads the hidden states back from the
graph's static output. The graph also computes the logits of every row (a decode step
samples each row), since the LM head's call alone cost as much host time as the rest of
the step's launch. Rows past the step's batch are padding: their K/V go nowhere
(slot -1) and they read no keys (seq_len 0, which the decode kernel answers with zeros).

The attention op reads the forward context only while a graph is being captured, so the
metadata it sees then (the static buffers; max_decode_seq_len at max_model_len, which the
kernels use for bounds, not for work) holds for every replay.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.engine.forward_context import forward_context
from common.engine.models.attention import AttentionMetadata
from kernels._backend import switched_off

logger = logging.getLogger(__name__)

# (capture the forward of one bucket, the memory pool to share) -> (replay, static outputs, pool)
GraphCapture = Callable[[Callable[[], tuple[torch.Tensor, ...]], object],
                        tuple[Callable[[], None], tuple[torch.Tensor, ...], object]]


def cuda_graphs_enabled() -> bool:
    """PDSERVE_CUDA_GRAPHS=0 turns graph replay off (the forward stays compiled)."""
    return not switched_off("PDSERVE_CUDA_GRAPHS")


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_num_seqs (and max_num_seqs itself): a batch
    pads to the next bucket, at most 7 rows of waste past 8."""
    buckets = [size for size in (1, 2, 4) if size < max_num_seqs]
    buckets += list(range(8, max_num_seqs, 8))
    return buckets + [max_num_seqs]


def capture_cuda_graph(fn: Callable[[], tuple[torch.Tensor, ...]], pool: object):
    """One CUDA graph of fn; buckets share one memory pool (captured largest first)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # [max_num_seqs] int64
    positions: torch.Tensor  # [max_num_seqs] int64
    slot_mapping: torch.Tensor  # [max_num_seqs] int64
    block_tables: torch.Tensor  # [max_num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_num_seqs] int32
    # [max_num_seqs] int64, 0, 1, ...: a decode step samples every row, so the forward keeps
    # them all, passed as the runner's steps pass keep_rows (one compiled form for both)
    all_rows: torch.Tensor

    def meta(self, num_seqs: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_seqs], num_decode_tokens=num_seqs,
            decode_block_tables=self.block_tables[:num_seqs], decode_seq_lens=self.seq_lens[:num_seqs],
            max_decode_seq_len=max_seq_len, prefill_block_tables=None, prefill_query_start_loc=None,
            prefill_seq_lens=None, max_prefill_query_len=0, max_prefill_seq_len=0)


class DecodeGraphs:
    """The captured decode graphs of one runner and the buffers they read."""

    def __init__(self, forward: Callable, kv_caches: list, device: torch.device, max_num_seqs: int,
                 max_model_len: int, block_size: int, capture: GraphCapture = capture_cuda_graph,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """compute_logits: hidden [rows, hidden] -> logits [rows, vocab], captured after the
        forward (None: the graphs give hidden states only, as on a stage that does not sample)."""
        self.forward = forward
        self.compute_logits = compute_logits
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = batch_size_buckets(max_num_seqs)
        max_blocks_per_seq = -(-max_model_len // block_size)
        self.static = _StaticInputs(
            input_ids=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
            positions=torch.zeros(max_num_seqs, dtype=torch.int64, device=device),
            slot_mapping=torch.full((max_num_seqs,), -1, dtype=torch.int64, device=device),
            block_tables=torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_num_seqs, dtype=torch.int32, device=device),
            all_rows=torch.arange(max_num_seqs, device=device))
        # bucket -> (replay, (static hidden states [bucket, hidden], logits [bucket, vocab] if computed))
        self._graphs: dict[int, tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        self._capture = capture
        self.num_replays = 0

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory."""
        started = time.perf_counter()
        pool = None
        static = self.static
        for size in sorted(self.buckets, reverse=True):
            meta = static.meta(size, self.max_model_len)

            def run(size=size, meta=meta) -> tuple[torch.Tensor, ...]:
                with forward_context(meta):
                    hidden = self.forward(static.input_ids[:size], static.positions[:size], self.kv_caches, meta,
                                          keep_rows=static.all_rows[:size])
                return (hidden,) if self.compute_logits is None else (hidden, self.compute_logits(hidden))

            run()  # compiles Triton kernels and inductor's chosen configs outside the capture
            replay, out, pool = self._capture(run, pool)
            self._graphs[size] = (replay, out)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self._graphs),
                    ",".join(map(str, self.buckets)), time.perf_counter() - started)

    def serves(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits a captured bucket, with no per-layer hook (a KV
        connector's layer-wise work runs Python between layers, which a graph cannot)."""
        return (bool(self._graphs) and meta.num_decode_tokens == num_tokens and 0 < num_tokens <= self.buckets[-1]
                and meta.kv_layer_hook is None and meta.decode_block_tables is not None
                and meta.decode_block_tables.shape[1] <= self.static.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids/positions [num_seqs] -> (hidden [num_seqs, hidden], logits [num_seqs, vocab]
        or None when not captured): views of the graph's outputs, valid until the next replay."""
        num_seqs = input_ids.shape[0]
        size = next(b for b in self.buckets if b >= num_seqs)
        static = self.static
        static.input_ids[:num_seqs].copy_(input_ids)
        static.positions[:num_seqs].copy_(positions)
        static.slot_mapping[:num_seqs].copy_(meta.slot_mapping)
        width = meta.decode_block_tables.shape[1]
        static.block_tables[:num_seqs, :width].copy_(meta.decode_block_tables)
        static.seq_lens[:num_seqs].copy_(meta.decode_seq_lens)
        if size > num_seqs:  # padding rows: no K/V written, no keys read
            static.input_ids[num_seqs:size].zero_()
            static.positions[num_seqs:size].zero_()
            static.slot_mapping[num_seqs:size].fill_(-1)
            static.seq_lens[num_seqs:size].zero_()
        replay, outputs = self._graphs[size]
        replay()
        self.num_replays += 1
        hidden = outputs[0][:num_seqs]
        return hidden, (outputs[1][:num_seqs] if len(outputs) > 1 else None)
