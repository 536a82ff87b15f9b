"""The proposers that draft tokens for the next step, behind one interface.

The runner gives a proposer the requests that sampled this step and asked for drafts
(ScheduledRequest.num_drafts_to_propose > 0) with the tokens they just emitted, and
gets back up to that many draft token ids each. A proposer that runs model layers
also sees every forward pass of the target (`observe_forward`), to keep its own KV.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.engine.models.attention import AttentionMetadata
from common.engine.native_decode import NativeDecodeLoop
from common.engine.outputs import ScheduledRequest
from common.engine.spec_decode.ngram_proposer import NgramProposer
from kernels.cpu_sampling import argmax_rows

if TYPE_CHECKING:
    from common.engine.config import SpeculativeConfig
    from common.engine.model_runner import ModelRunner


def history_len(req: ScheduledRequest, emitted_token_ids: list[int]) -> int:
    """Tokens the request holds once this step's emitted tokens are appended."""
    return len(req.prompt_token_ids) + len(req.output_token_ids) + len(emitted_token_ids)


class DraftProposer(ABC):
    # KV bytes per block the proposer's own layers add to the pool (0: it keeps none).
    kv_bytes_per_block: int = 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Its own KV pool, with the target's block ids (the same block tables index it)."""

    def build_native_loop(self) -> None:
        """The engine's decode steps run in the native loop (CPU, compiled): a proposer that
        runs model layers builds its own for its decode-only passes."""

    def observe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        scheduled: list[ScheduledRequest]) -> None:
        """The target just ran these tensors of a step (its own KV must follow them)."""

    def remove_requests(self, req_ids: list[str]) -> None:
        """Finished requests: drop what is kept for them."""

    @abstractmethod
    def propose(self, requests: list[ScheduledRequest],
                emitted_token_ids: list[list[int]]) -> list[list[int]]:
        """Up to requests[i].num_drafts_to_propose drafts for each request, to follow
        its history extended by emitted_token_ids[i]."""


class NgramDraftProposer(DraftProposer):
    """Prompt lookup: no model, no KV; drafts the tokens that followed the last
    occurrence of the request's most recent n-gram."""

    def __init__(self, config: "SpeculativeConfig"):
        self.lookup = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                    config.prompt_lookup_max)

    def propose(self, requests: list[ScheduledRequest],
                emitted_token_ids: list[list[int]]) -> list[list[int]]:
        histories = [req.prompt_token_ids + req.output_token_ids + emitted
                     for req, emitted in zip(requests, emitted_token_ids)]
        return [drafts[:req.num_drafts_to_propose]
                for req, drafts in zip(requests, self.lookup.propose(histories))]


# Runs a draft forward pass over a step's tensors -> hidden states [num_tokens, hidden_size].
DraftForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def through_loop(loop: NativeDecodeLoop | None, forward: DraftForward) -> DraftForward:
    """forward, with the decode-only passes the loop serves run in the loop (one native call
    through every layer, where the eager model pays Python and a fork per op)."""
    if loop is None:
        return forward

    def run(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if loop.serves(input_ids.shape[0], meta):
            return loop.run(input_ids, positions, meta)  # [num_tokens, hidden_size]
        return forward(input_ids, positions, meta)
    return run


def draft_greedily(runner: "ModelRunner", forward: DraftForward, compute_logits: Callable,
                   requests: list[ScheduledRequest], emitted_token_ids: list[list[int]]) -> list[list[int]]:
    """Greedy drafts, one batched decode pass per draft position: pass j feeds each
    request's newest token at its position and takes the argmax as its next draft.
    The passes write the draft layers' KV at the draft positions, in slots the
    scheduler allocated ahead (num_lookahead_tokens); verification overwrites them."""
    block_size = runner.block_size
    drafts: list[list[int]] = [[] for _ in requests]
    next_token_ids = [emitted[-1] for emitted in emitted_token_ids]
    positions = [history_len(req, emitted) - 1 for req, emitted in zip(requests, emitted_token_ids)]
    while True:
        rows = [i for i, req in enumerate(requests)
                if len(drafts[i]) < req.num_drafts_to_propose
                and positions[i] < len(req.block_table) * block_size]
        if not rows:
            return drafts
        batch = [ScheduledRequest(req_id=requests[i].req_id, token_ids=[next_token_ids[i]], start_pos=positions[i],
                                  block_table=requests[i].block_table, do_sample=True,
                                  sampling_params=requests[i].sampling_params) for i in rows]
        input_ids, step_positions, meta, sample_indices, _ = runner.prepare_inputs(batch)
        hidden = forward(input_ids, step_positions, meta)  # [num_rows, hidden_size]
        draft_token_ids = argmax_rows(compute_logits(hidden[sample_indices])).tolist()  # [num_rows]
        for i, token_id in zip(rows, draft_token_ids):
            drafts[i].append(token_id)
            next_token_ids[i] = token_id
            positions[i] += 1


class EarlyExitDraftProposer(DraftProposer):
    """The target's first E layers, its final norm and tied head as the draft: no extra
    weights and no extra KV (the draft's KV is the target's own first E layers', which
    verification rewrites from the same tokens), nothing extra to transfer."""

    def __init__(self, config: "SpeculativeConfig", runner: "ModelRunner"):
        num_layers = runner.model_config.num_hidden_layers
        self.num_exit_layers = config.num_early_exit_layers or max(1, num_layers // 4)
        if self.num_exit_layers >= num_layers:
            raise ValueError(f"num_early_exit_layers={self.num_exit_layers} must be fewer than the "
                             f"model's {num_layers} layers")
        self.runner = runner
        self.loop: NativeDecodeLoop | None = None  # the first layers' decode passes (build_native_loop)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.loop = None  # it writes the caches it was built with; build_native_loop builds it anew

    def build_native_loop(self) -> None:
        runner = self.runner
        self.loop = NativeDecodeLoop.build(runner.model, runner.kv_caches, self.num_exit_layers, role="draft")

    def propose(self, requests: list[ScheduledRequest],
                emitted_token_ids: list[list[int]]) -> list[list[int]]:
        runner = self.runner

        def forward(input_ids, positions, meta):
            return runner.model(input_ids, positions, runner.kv_caches, meta, num_layers=self.num_exit_layers)

        return draft_greedily(runner, through_loop(self.loop, forward), runner.model.compute_logits, requests,
                              emitted_token_ids)


def make_proposer(config: "SpeculativeConfig", runner: "ModelRunner") -> DraftProposer:
    if config.method == "ngram":
        return NgramDraftProposer(config)
    if config.method == "early_exit":
        return EarlyExitDraftProposer(config, runner)
    from common.engine.spec_decode.draft_model_proposer import DraftModelProposer
    return DraftModelProposer(config, runner)
