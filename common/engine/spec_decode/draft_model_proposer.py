"""A separate, smaller model as the draft (it must share the target's tokenizer).

Its KV lives in its own layers of the same paged pool geometry: the same block ids,
block tables and slot mappings index it, so the scheduler allocates one set of
blocks for both models. The draft runs over every token the target computes (the
target's own step tensors), and over a request's earlier tokens the first time it
sees the request after a prefix-cache hit or a KV import: in a disaggregated stack
the decode instance prefills the draft locally rather than having prefill ship the
draft's layers (the draft is small; shipping would tie both pools to one draft).
Under tensor or pipeline parallelism it lives whole on the rank that samples.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.engine.compilation import pack_eager_linears
from common.engine.config import ModelConfig
from common.engine.distributed import parallel_state
from common.engine.model_files import load_hf_config, resolve_model
from common.engine.models.attention import AttentionMetadata
from common.engine.models.prepacked_linear import prepack_linears
from common.engine.native_decode import NativeDecodeLoop
from common.engine.outputs import ScheduledRequest
from common.engine.spec_decode.proposer import DraftProposer, draft_greedily, through_loop

if TYPE_CHECKING:
    from common.engine.config import SpeculativeConfig
    from common.engine.model_runner import ModelRunner


def draft_model_config(config: "SpeculativeConfig") -> tuple[ModelConfig, Path]:
    """The draft model's config and the directory it loads from."""
    draft_dir = resolve_model(config.draft_model)
    return ModelConfig.from_hf_config(load_hf_config(draft_dir)), draft_dir


class DraftModelProposer(DraftProposer):
    def __init__(self, config: "SpeculativeConfig", runner: "ModelRunner"):
        from common.engine.model_runner import load_model  # model_runner imports the proposers
        self.model_config, draft_dir = draft_model_config(config)
        target_vocab_size = runner.model_config.vocab_size
        if self.model_config.vocab_size != target_vocab_size:
            raise ValueError(f"draft model {config.draft_model!r} has a vocabulary of "
                             f"{self.model_config.vocab_size} tokens, the target {target_vocab_size}: "
                             f"a draft must share the target's tokenizer")
        self.runner = runner
        # Whole, on the one rank that samples and drafts (vLLM's draft_tensor_parallel_size 1):
        # the draft is small, and its passes then wait on no other rank.
        with parallel_state.one_rank_view():
            self.model = load_model(self.model_config, draft_dir, runner.device, runner.dtype)
        # On the CPU's packed linears, as an eager target's are: the draft is never compiled.
        pack_eager_linears(self.model)
        self.kv_bytes_per_block = runner.block_size * self.model_config.kv_bytes_per_token(
            runner.kv_cache_dtype.itemsize)
        # Per draft layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen_req_ids: set[str] = set()
        self.loop: NativeDecodeLoop | None = None  # the draft's decode passes (build_native_loop)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        from common.engine.model_runner import allocate_paged_kv
        runner = self.runner
        self.loop = None  # it writes the caches it was built with; build_native_loop builds it anew
        self.kv_caches = allocate_paged_kv(self.model_config, num_blocks, runner.block_size, runner.kv_cache_dtype,
                                           runner.device, populating_stop=runner.kv_populating_stop)

    def build_native_loop(self) -> None:
        # The loop reads the packed linears' decode weights (packed at load unless switched off
        # there; a draft packed before packs nothing again).
        prepack_linears(self.model)
        self.loop = NativeDecodeLoop.build(self.model, self.kv_caches, role="draft")

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return through_loop(self.loop, self._model_forward)(input_ids, positions, meta)

    def _model_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def observe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        scheduled: list[ScheduledRequest]) -> None:
        catch_up = []
        for req in scheduled:
            if req.req_id not in self.seen_req_ids:
                self.seen_req_ids.add(req.req_id)
                if req.start_pos > 0:
                    history = req.prompt_token_ids + req.output_token_ids
                    catch_up.append(dataclasses.replace(req, token_ids=history[:req.start_pos], start_pos=0,
                                                        do_sample=False, spec_token_ids=[]))
        if catch_up:
            catch_up_ids, catch_up_positions, catch_up_meta, _, _ = self.runner.prepare_inputs(catch_up)
            self._forward(catch_up_ids, catch_up_positions, catch_up_meta)
        # The target's tensors as they are, less its KV-connector hook (the draft's
        # layers are not transferred).
        self._forward(input_ids, positions, dataclasses.replace(meta, kv_layer_hook=None))

    def remove_requests(self, req_ids: list[str]) -> None:
        self.seen_req_ids.difference_update(req_ids)

    def propose(self, requests: list[ScheduledRequest],
                emitted_token_ids: list[list[int]]) -> list[list[int]]:
        return draft_greedily(self.runner, self._forward, self.model.compute_logits, requests, emitted_token_ids)
