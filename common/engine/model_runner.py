"""Runs the model for one scheduled step: builds every tensor of the step, then samples.

Under tensor/pipeline parallelism (vLLM's design) one ModelRunner runs per rank, every
rank gets the same SchedulerOutput each step and builds the same step tensors; its
model holds its rank's shard of its stage's layers. A stage after the first receives the
previous stage's hidden states instead of embedding; a stage before the last sends its
own on. Only the output rank (tp_rank 0 of the last stage) samples; the others return an
empty RunnerOutput, and next step's tokens reach them in the next SchedulerOutput.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from itertools import accumulate
from pathlib import Path

import torch
from safetensors import safe_open

from common.engine.compilation import compile_forward, compile_logits, num_compiled_graphs
from common.engine.config import KVTransferConfig, LoRAConfig, ModelConfig, ParallelConfig, SpeculativeConfig
from common.engine.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
from common.engine.device import select_device, select_dtype, select_kv_cache_dtype
from common.engine.distributed import parallel_state
from common.engine.forward_context import forward_context
from common.engine.heap_retention import release_freed_heap
from common.engine.kv_connector.factory import make_worker_connector
from common.engine.kv_connector.layout import describe_kv_layout, kv_layout, kv_layout_hash
from common.engine.lora.manager import LoRAManager
from common.engine.models.attention import AttentionMetadata
from common.engine.models.causal_lm import CausalLM, build_rope
from common.engine.models.parallel_layers import kv_head_partition
from common.engine.models.quantization import QuantizationSpec, quantize_model
from common.engine.models.registry import model_class
from common.engine.native_decode import NativeDecodeLoop
from common.engine.openmp_teams import LoadingThreadWatch
from common.engine.outputs import Logprobs, RunnerOutput, ScheduledRequest, SchedulerOutput
from common.engine.prompt_pooler import PromptPooler
from common.engine.sampler import Sampler
from common.engine.spec_decode.draft_model_proposer import draft_model_config
from common.engine.spec_decode.proposer import DraftProposer, make_proposer
from common.engine.spec_decode.verification import accept_drafts, expand_verification_rows
from kernels.cpu_attention import dtype_pair, prefer_build
from kernels.huge_pages import populate_in_background, wait_until_populated, zeros_on_huge_pages

logger = logging.getLogger(__name__)


def load_model(model_config: ModelConfig, model_dir: Path, device: torch.device,
               dtype: torch.dtype, quantization: QuantizationSpec | None = None) -> CausalLM:
    """The model with this rank's shard of its stage's layers (parallel_state says which)."""
    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config)
    # What Module.to_empty does, with torch.empty in place of torch.empty_like: empty_like
    # of a meta tensor runs torch._refs, which imports sympy (~0.7 s of every engine's
    # start-up). _apply keeps a parameter shared by two modules one parameter.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    # That leaves the RoPE tables (buffers) uninitialised too: rebuild them on the device.
    model.rope = build_rope(model_config).to(device)
    files = sorted(model_dir.glob("*.safetensors"))

    def weights():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    model.load_weights(weights())
    model = model.to(dtype).eval()
    if quantization is not None:
        quantize_model(model, quantization)
    return model


def attention_head_dims(model_config: ModelConfig, speculative_config: SpeculativeConfig | None) -> list[int]:
    """The head dims this engine's attention runs at: its model's and a draft model's."""
    head_dims = [model_config.head_dim]
    if speculative_config is not None and speculative_config.method == "draft_model":
        head_dims.append(draft_model_config(speculative_config)[0].head_dim)
    return head_dims


def allocate_paged_kv(model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device, num_layers: int | None = None,
                      num_kv_heads: int | None = None,
                      populating_stop: threading.Event | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]; num_layers and
    num_kv_heads (default: the model's) are one rank's under tensor/pipeline parallelism;
    populating_stop, once set, ends the faulting in of the pool's pages (populate_in_background).

    Zeroed, not empty: attention reads whole blocks and masks the tail, and garbage
    NaNs would survive a zero weight (0 * NaN = NaN). On the CPU in huge pages
    (kernels/huge_pages.py): the TLB caps a decode step's scattered block reads on 4 KiB
    pages. Their pages fault in on a thread of their own, since on a VM whose host backs
    guest memory lazily a fresh GiB of huge pages can take seconds."""
    num_layers = model_config.num_hidden_layers if num_layers is None else num_layers
    num_kv_heads = model_config.num_key_value_heads if num_kv_heads is None else num_kv_heads
    shape = (num_blocks, block_size, num_kv_heads, model_config.head_dim)
    if device.type != "cpu":
        return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)]
    caches = [(zeros_on_huge_pages(shape, dtype), zeros_on_huge_pages(shape, dtype)) for _ in range(num_layers)]
    populate_in_background([cache for pair in caches for cache in pair], populating_stop)
    return caches


def check_parallel_setup(model_config: ModelConfig, parallel: ParallelConfig, rank: int,
                         kv_transfer_config: KVTransferConfig | None,
                         speculative_config: SpeculativeConfig | None) -> None:
    """Raise before loading anything where this rank cannot run its share of the model."""
    model_config.verify_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
    parallel.check_supports(kv_transfer_config, speculative_config)
    if parallel.world_size == 1:
        return
    state = parallel_state.get_state()
    layout = (state.tp_size, state.pp_size, state.rank)
    if layout != (parallel.tensor_parallel_size, parallel.pipeline_parallel_size, rank):
        raise RuntimeError(f"rank {rank} of tensor_parallel_size {parallel.tensor_parallel_size} x "
                           f"pipeline_parallel_size {parallel.pipeline_parallel_size} needs "
                           f"parallel_state.initialize_model_parallel first (it has tp {state.tp_size}, "
                           f"pp {state.pp_size}, rank {state.rank})")


def upload_int_lists(lists: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """The lists as 1-D tensors on device: views of one tensor, so a GPU step makes one
    asynchronous copy from pinned memory rather than a blocking copy per list (each of
    those waits for the GPU). The caching host allocator keeps the pinned buffer until
    the copy has run."""
    pinned = device.type == "cuda"
    host = torch.tensor([v for values in lists for v in values], dtype=dtype, pin_memory=pinned)
    whole = host.to(device, non_blocking=True) if pinned else host.to(device)
    views, start = [], 0
    for values in lists:
        views.append(whole[start:start + len(values)])
        start += len(values)
    return views


# A step prefilling at least this many prompt tokens runs on num_prefill_threads: below it
# the step is too short for more threads to pay for waking them.
PREFILL_THREADS_MIN_TOKENS = 32


PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are held at once (x vocab floats)


def split_step(scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], list[ScheduledRequest]]:
    """(decode rows, prefill chunks): a step's rows are the first's (one query token each,
    drafts included), then the second's; every scheduled request computes at least one known
    token before its drafts."""
    return ([r for r in scheduled if len(r.token_ids) == 1 + len(r.spec_token_ids)],
            [r for r in scheduled if len(r.token_ids) > 1 + len(r.spec_token_ids)])


def in_row_order(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The step's requests in the order of its rows (prepare_inputs': decode rows, then
    prefill chunks)."""
    decodes, prefills = split_step(scheduled)
    return decodes + prefills


def pools(scheduled: list[ScheduledRequest]) -> bool:
    """Whether a request of the step pools its prompt's hidden states (an embedding)."""
    return any(r.do_pool or r.pooling_type for r in scheduled)


def asks_prompt_logprobs(scheduled: list[ScheduledRequest]) -> bool:
    """Whether a request of the step asks for its prompt's logprobs."""
    return any(r.sampling_params.prompt_logprobs is not None for r in scheduled)


def step_num_threads(scheduler_output: SchedulerOutput, num_prefill_threads: int | None) -> int | None:
    """The torch threads this step runs on: num_prefill_threads where it prefills at least
    PREFILL_THREADS_MIN_TOKENS prompt tokens (chunks of more than one known token; decodes
    and their drafts do not count), else None (the process's own)."""
    if num_prefill_threads is None:
        return None
    num_prefill_tokens = 0
    for req in scheduler_output.scheduled:
        num_known_tokens = len(req.token_ids) - len(req.spec_token_ids)
        if num_known_tokens > 1:
            num_prefill_tokens += num_known_tokens
    return num_prefill_threads if num_prefill_tokens >= PREFILL_THREADS_MIN_TOKENS else None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_dir: Path, device: str = "auto",
                 dtype: str = "auto", seed: int = 0, block_size: int = 16, kv_cache_dtype: str = "auto",
                 kv_transfer_config: KVTransferConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, enforce_eager: bool = False,
                 quantization: QuantizationSpec | None = None, parallel_config: ParallelConfig | None = None,
                 rank: int = 0, single_weight_copy: bool = False, num_prefill_threads: int | None = None,
                 lora_config: LoRAConfig | None = None):
        self.parallel_config = parallel_config or ParallelConfig()
        check_parallel_setup(model_config, self.parallel_config, rank, kv_transfer_config, speculative_config)
        self.model_config = model_config
        self.rank = rank
        tp_size = self.parallel_config.tensor_parallel_size
        # The executor returns this rank's output: tp_rank 0 of the last stage.
        self.is_output_rank = rank == (self.parallel_config.pipeline_parallel_size - 1) * tp_size
        self.device = select_device(device)
        if self.device.type == "cuda" and self.parallel_config.world_size > 1:
            self.device = torch.device("cuda", rank % torch.cuda.device_count())  # ranks take GPUs round-robin
        self.dtype = select_dtype(dtype, self.device)
        # What the paged KV cache holds: self.dtype, or fp8 codes of it.
        self.kv_cache_dtype = select_kv_cache_dtype(kv_cache_dtype, self.dtype, self.device)
        self.block_size = block_size
        if self.device.type == "cpu":  # before anything loads the attention library
            prefer_build(attention_head_dims(model_config, speculative_config),
                         [dtype_pair(self.dtype, self.kv_cache_dtype)])
        self.model = load_model(model_config, model_dir, self.device, self.dtype, quantization)
        # LoRA adapters' deltas in every decoder linear (None: none served): an op of the
        # compiled graph (lora/layers.py), which the native decode loop adds itself for the
        # adapters registered with it (LoRAManager.register_with); CUDA graphs stay off.
        self.lora_manager: LoRAManager | None = None
        if lora_config is not None and lora_config.enable_lora:
            self.lora_manager = LoRAManager(self.model, model_config, lora_config.max_lora_rank, self.dtype,
                                            self.device)
            logger.info("LoRA adapters served (up to %d at once, rank <= %d); no CUDA graphs", lora_config.max_loras,
                        lora_config.max_lora_rank)
        # The forward pass as run each step: compiled unless enforce_eager (the model
        # itself stays eager for a draft that runs part of it). Ranks of a parallel run
        # stay eager: their collectives and stage transfers are not compiler-safe ops.
        self.forward = compile_forward(self.model, self.device,
                                       enforce_eager or self.parallel_config.world_size > 1, single_weight_copy,
                                       dynamic_threads=num_prefill_threads not in (None, torch.get_num_threads()),
                                       single_rank=self.parallel_config.world_size == 1)
        # Logits of the sampled rows: compiled with the forward, or eager with it.
        self.compute_logits = compile_logits(self.model, self.forward)
        if self.device.type == "cpu":
            release_freed_heap()  # the weights as loaded, where the linears made their own copies
        # This rank's share of the KV: its stage's layers, its KV heads.
        self.num_local_layers = len(self.model.layers)
        self.num_local_kv_heads = kv_head_partition(model_config.num_key_value_heads, rank % tp_size, tp_size)[1]
        self.sampler = Sampler(eos_token_ids=model_config.eos_token_ids, seed=seed)
        self.prompt_pooler = PromptPooler()  # embedding requests' pooling across their chunks
        # Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim].
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Set once the KV pools (the draft's too) are shut down or replaced: their pages are
        # faulted in no further.
        self.kv_populating_stop = threading.Event()
        # The worker half of the KV connector (None: this engine moves no KV in or out).
        self.kv_connector = make_worker_connector(kv_transfer_config or KVTransferConfig(), rank % tp_size, tp_size,
                                                  model_config.num_key_value_heads)
        # Drafts the next step's speculative tokens (None: no speculative decoding, or a rank
        # that does not sample: the drafts follow the sampled tokens), except where the draft
        # is the target's own first layers: every TP rank then runs the draft passes, with the
        # sampled tokens the output rank sends (drafts_on_every_rank).
        self.drafts_on_every_rank = (speculative_config is not None and speculative_config.drafts_with_target_layers
                                     and self.parallel_config.world_size > 1)
        self.proposer: DraftProposer | None = (
            make_proposer(speculative_config, self)
            if speculative_config is not None and (self.is_output_rank or self.drafts_on_every_rank) else None)
        # Decode-only steps replayed from CUDA graphs (None: not on CUDA, not compiled, or off).
        self.decode_graphs: DecodeGraphs | None = None
        # Decode-only CPU steps of a few tokens through every layer in one native call
        # (None: not on the CPU, not compiled, or the model is not one it serves).
        self.native_decode: NativeDecodeLoop | None = None
        # CPU: torch threads of the steps that prefill (step_num_threads); None: the process's.
        self.num_prefill_threads = num_prefill_threads if self.device.type == "cpu" else None
        # CPU: stepped from another thread than this one while it lives, libgomp keeps two teams.
        self.loading_thread = LoadingThreadWatch() if self.device.type == "cpu" else None

    @property
    def kv_bytes_per_block(self) -> int:
        """This rank's KV per block (its layers, its KV heads), plus a draft model's own layers
        if it has one."""
        draft_bytes = self.proposer.kv_bytes_per_block if self.proposer is not None else 0
        target_bytes = self.model_config.kv_bytes_per_token(self.kv_cache_dtype.itemsize, self.num_local_layers,
                                                            self.num_local_kv_heads)
        return self.block_size * target_bytes + draft_bytes

    def free_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("cannot read MemAvailable from /proc/meminfo")

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.native_decode = None  # it writes the caches it was built with; warm_up builds it anew
        self.kv_populating_stop.set()  # a pool replaced is not faulted in any further
        self.kv_populating_stop = threading.Event()
        self.kv_caches = allocate_paged_kv(self.model_config, num_blocks, self.block_size, self.kv_cache_dtype,
                                           self.device, self.num_local_layers, self.num_local_kv_heads,
                                           self.kv_populating_stop)
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)

    def wait_kv_cache_resident(self, timeout_s: float) -> bool:
        """Wait, up to timeout_s, until the CPU KV pool's pages are faulted in (allocate_paged_kv
        leaves that to a background thread); whether they are. True at once on a GPU."""
        return wait_until_populated(timeout_s)

    @torch.inference_mode()  # as execute_model: inference tensors, or dynamo's guards differ
    def warm_up(self, max_num_seqs: int | None = None, max_model_len: int | None = None) -> None:
        """Compile the forward pass and the logits before the first request: one graph each,
        for every number of tokens (rows). The token dimension is marked unbacked: a
        dynamic ("backed") size would still be specialised at 1, and the one-token graph
        would double the compile time; an unbacked one has no size guard at all.

        On CUDA, given the scheduler's max_num_seqs and max_model_len, then capture the
        decode steps' CUDA graphs (common/engine/cuda_graphs.py); on the CPU, register the
        model with the native decode loop (common/engine/native_decode.py). In every mode, load
        the sampler's native kernels (Sampler.prepare), last: on a cold start compile_forward's
        background build has made them meanwhile."""
        if self.forward is not self.model and self.kv_caches:
            self._compile()
            if self.device.type == "cpu" and self.parallel_config.world_size == 1:
                self.native_decode = NativeDecodeLoop.build(self.model, self.kv_caches)
                if self.native_decode is not None and self.proposer is not None:
                    self.proposer.build_native_loop()
                if self.native_decode is not None and self.lora_manager is not None:
                    self.lora_manager.register_with(self.native_decode.register_adapter)
            if (self.device.type == "cuda" and max_num_seqs and max_model_len and cuda_graphs_enabled()
                    and self.parallel_config.world_size == 1 and self.lora_manager is None):
                self.decode_graphs = DecodeGraphs(
                    self.forward, self.kv_caches, self.device, max_num_seqs, max_model_len, self.block_size,
                    compute_logits=self.compute_logits if self.is_output_rank else None)
                self.decode_graphs.capture_all()
        self.sampler.prepare(self.device)

    def num_threads(self) -> int:
        """This rank's torch threads (a worker's are its share of the host's CPUs)."""
        return torch.get_num_threads()

    def runs_decode_steps(self) -> bool:
        """Whether this runner takes SchedulerOutput.num_steps > 1: the native loop's token
        steps (elsewhere every step is a single one)."""
        return self.native_decode is not None and self.native_decode.max_head_tokens > 0

    def _compile(self) -> None:
        started = time.perf_counter()
        graphs_before = num_compiled_graphs()
        for num_tokens in (1, 2):  # the second call checks that the first graph serves it
            # One prompt whose K/V go nowhere (slot -1), reading block 0: nothing is cached yet.
            meta = AttentionMetadata(
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
                num_decode_tokens=0, decode_block_tables=None, decode_seq_lens=None, max_decode_seq_len=0,
                prefill_block_tables=torch.zeros((1, 1), dtype=torch.int32, device=self.device),
                prefill_query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
                prefill_seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
                max_prefill_query_len=num_tokens, max_prefill_seq_len=num_tokens)
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            positions = torch.arange(num_tokens, device=self.device)
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
            # As a step keeps its rows (_kept_rows): here the last, and a count of its own.
            keep_rows = None
            if self.model.is_last_stage:
                keep_rows = torch.full((1,), num_tokens - 1, dtype=torch.int64, device=self.device)
                torch._dynamo.decorators.mark_unbacked(keep_rows, 0)
            with forward_context(meta):
                hidden = self.forward(input_ids, positions, self.kv_caches, meta, keep_rows=keep_rows)
            if self.model.is_last_stage:
                torch._dynamo.decorators.mark_unbacked(hidden, 0)
                self.compute_logits(hidden)
        logger.info("compiled the model in %.1f s (%d graphs)", time.perf_counter() - started,
                    num_compiled_graphs() - graphs_before)

    def kv_connector_info(self) -> dict:
        """Plain data about this rank's KV connector (pool geometry, receiving endpoint, the
        hash of what the transferred KV means, the tensor-parallel split of the KV heads);
        {} if none."""
        if self.kv_connector is None:
            return {}
        info = self.kv_connector.info()  # its "dtype" is the pool's, as the transfer names it
        layout = kv_layout(self.model_config, info["dtype"], self.block_size)
        return info | {"kv_layout_hash": kv_layout_hash(layout), "kv_layout": describe_kv_layout(layout),
                       "num_kv_heads": self.model_config.num_key_value_heads,
                       "tensor_parallel_size": self.parallel_config.tensor_parallel_size}

    def shutdown(self) -> None:
        self.kv_populating_stop.set()
        if self.kv_connector is not None:
            self.kv_connector.close()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if scheduler_output.finished_req_ids:
            self.sampler.remove_requests(scheduler_output.finished_req_ids)
            self.prompt_pooler.remove(scheduler_output.finished_req_ids)
            if self.proposer is not None:
                self.proposer.remove_requests(scheduler_output.finished_req_ids)
        connector = self.kv_connector
        if connector is not None and scheduler_output.kv_connector_metadata is not None:
            connector.start_load_kv(scheduler_output.kv_connector_metadata)
        output = RunnerOutput(req_ids=[], sampled_token_ids=[])
        if not scheduler_output.is_empty:
            if self.loading_thread is not None:
                self.loading_thread.check()
            num_threads = step_num_threads(scheduler_output, self.num_prefill_threads)
            process_threads = torch.get_num_threads()
            if num_threads is None or num_threads == process_threads:
                output = self._run_model(scheduler_output)
            else:
                torch.set_num_threads(num_threads)
                try:
                    output = self._run_model(scheduler_output)
                finally:
                    torch.set_num_threads(process_threads)
        if connector is not None:
            outcomes = connector.get_finished()
            output.kv_transfer_outcomes = outcomes
            output.finished_sending = [o.req_id for o in outcomes if o.direction == "send"]
            output.finished_recving = [o.req_id for o in outcomes if o.direction == "recv"]
        return output

    def _run_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, sample_indices, sample_reqs = self.prepare_inputs(
            scheduler_output.scheduled)
        connector = self.kv_connector
        if connector is not None and connector.needs_layer_hook:
            meta.kv_layer_hook = self._kv_layer_hook
        model = self.model
        # One row per sampled position: a request verifying k drafts samples k + 1.
        sample_rows = expand_verification_rows(sample_reqs)
        received = None  # the previous stage's hidden states [num_tokens, hidden]
        graph_logits = None  # [num_tokens, vocab] when a graph computed them
        loop_output = None  # where the native loop took the step to its tokens
        # [num_tokens, hidden], or the kept rows' [num_kept, hidden] (_kept_rows), unless the loop
        # took the step to its tokens
        hidden = None
        if not model.is_first_stage:
            received = parallel_state.recv_from_prev_stage(
                (input_ids.shape[0], self.model_config.hidden_size), self.dtype, self.device)
        try:
            graphs = self.decode_graphs
            loop = self._native_loop(scheduler_output)
            if received is None and graphs is not None and graphs.serves(input_ids.shape[0], meta):
                hidden, graph_logits = graphs.run(input_ids, positions, meta)  # [num_tokens, hidden]
            elif received is None and self._loop_samples(scheduler_output, input_ids.shape[0], meta, sample_rows):
                loop_output = self._run_loop_tokens(scheduler_output, input_ids, positions, meta, sample_rows)
            elif received is None and loop is not None and loop.serves(input_ids.shape[0], meta):
                # [num_tokens, hidden]
                hidden = loop.run(input_ids, positions, meta, self._loop_lora_ids(scheduler_output))
            else:
                keep_rows = self._kept_rows(scheduler_output, input_ids.shape[0], sample_indices)
                with self._lora_step(scheduler_output.scheduled, keep_rows):
                    hidden = self._forward(input_ids, positions, meta, received, keep_rows)
        except BaseException:
            if connector is not None:  # a half-written pool must not reach a peer as final
                connector.abort_saves("the forward pass failed")
            raise
        if not model.is_last_stage:
            parallel_state.send_to_next_stage(hidden)
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        # A step the loop took to its tokens holds decode rows alone: no prompt positions.
        prompt_logprobs = None if loop_output is not None else self._prompt_logprobs(hidden, scheduler_output)
        output = self._sampled_output(scheduler_output, hidden, graph_logits, loop_output, sample_indices,
                                      sample_reqs, sample_rows, input_ids, positions, meta)
        output.prompt_logprobs = prompt_logprobs
        scheduled = scheduler_output.scheduled
        # Nearly every step holds no embedding request: no row order to rebuild.
        if self.is_output_rank and hidden is not None and pools(scheduled):
            output.pooled_hidden = self.prompt_pooler.pool_step(in_row_order(scheduled), hidden)
        return output

    def _sampled_output(self, scheduler_output: SchedulerOutput, hidden: torch.Tensor | None,
                        graph_logits: torch.Tensor | None, loop_output: RunnerOutput | None,
                        sample_indices: torch.Tensor, sample_reqs: list[ScheduledRequest],
                        sample_rows: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> RunnerOutput:
        """The step's tokens from its last stage's hidden states [num_tokens, hidden] (or the
        kept rows', which are the sampled ones, or the loop's own output), with the drafts for
        the next step."""
        connector = self.kv_connector
        if connector is not None:
            connector.wait_for_save()
        proposer = self.proposer
        if proposer is not None:
            proposer.observe_forward(input_ids, positions, meta, scheduler_output.scheduled)
        if loop_output is not None:
            if proposer is None:
                return loop_output
            # One token a sample row from the loop: its drafts accepted as the sampler's are.
            return self._accepted(sample_reqs, [token_ids[0] for token_ids in loop_output.sampled_token_ids],
                                  None if loop_output.logprobs is None
                                  else [logprobs[0] if logprobs else None for logprobs in loop_output.logprobs])
        if not sample_reqs:
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        # Every TP rank of the last stage takes part in gathering the logits; one samples.
        # Sample indices are increasing, so as many as the rows are every row (each decode step).
        every_row = sample_indices.shape[0] == hidden.shape[0]
        token_bitmask, bitmask_rows = self._grammar_bitmask(scheduler_output, sample_rows)
        logits = None  # [num_sample_rows, vocab]
        if every_row and graph_logits is not None:
            logits = graph_logits
        else:
            sampled_hidden = hidden if every_row else hidden[sample_indices]
            if token_bitmask is None and self.sampler.only_argmax(sample_rows):
                logits = self.model.compute_argmax_logits(sampled_hidden)
            if logits is None:
                logits = self.compute_logits(sampled_hidden)
        if not self.is_output_rank:
            if self.drafts_on_every_rank:  # this rank's share of the draft passes, from the sampled rows
                row_token_ids = self._sampled_rows_from_output_rank(None, len(sample_rows))
                self._propose(sample_reqs, accept_drafts(sample_reqs, row_token_ids, None)[0])
            return RunnerOutput(req_ids=[], sampled_token_ids=[])
        sampled = self.sampler(logits, sample_rows, token_bitmask, bitmask_rows)
        if self.drafts_on_every_rank:
            self._sampled_rows_from_output_rank(sampled.sampled_token_ids, len(sample_rows))
        return self._accepted(sample_reqs, sampled.sampled_token_ids, sampled.logprobs)

    def _sampled_rows_from_output_rank(self, row_token_ids: list[int] | None, num_rows: int) -> list[int]:
        """The sampled row tokens as the output rank (TP rank 0) has them, on every TP rank."""
        values = torch.tensor(row_token_ids if row_token_ids is not None else [0] * num_rows, dtype=torch.int64,
                              device=self.device)  # [num_rows]
        return parallel_state.tp_broadcast_from_first(values).tolist()

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduler_output: SchedulerOutput
                         ) -> dict[str, tuple[int, list[Logprobs]]] | None:
        """For each request asking for prompt_logprobs whose chunk holds positions p followed by
        a prompt token: at each, that token's logprob and the top alternatives (the raw
        logits' log-softmax, as vLLM gives them), as (the first p, one Logprobs a position).
        Every TP rank of the last stage takes part (compute_logits gathers). hidden:
        [num_tokens, hidden], rows in split_step's order."""
        if not asks_prompt_logprobs(scheduler_output.scheduled):
            return None
        results: dict[str, tuple[int, list[Logprobs]]] = {}
        row = 0
        for req in in_row_order(scheduler_output.scheduled):
            num_top = req.sampling_params.prompt_logprobs
            end = min(req.start_pos + len(req.token_ids), len(req.prompt_token_ids) - 1)
            if num_top is not None and req.start_pos < end:
                target_ids = req.prompt_token_ids[req.start_pos + 1:end + 1]
                results[req.req_id] = (req.start_pos,
                                       self._logprobs_of(hidden[row:row + end - req.start_pos], target_ids, num_top))
            row += len(req.token_ids)
        return results or None

    def _logprobs_of(self, hidden: torch.Tensor, target_ids: list[int], num_top: int) -> list[Logprobs]:
        """Each row's log-softmax at target_ids' token and its num_top largest, in slices of
        PROMPT_LOGPROBS_ROWS rows (a whole chunk's logits would be chunk x vocab floats).
        hidden: [num_rows, hidden]."""
        vocab_size = self.model_config.vocab_size
        results: list[Logprobs] = []
        for start in range(0, hidden.shape[0], PROMPT_LOGPROBS_ROWS):
            logits = self.compute_logits(hidden[start:start + PROMPT_LOGPROBS_ROWS])[:, :vocab_size]  # [rows, vocab]
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
            targets = torch.tensor(target_ids[start:start + PROMPT_LOGPROBS_ROWS], device=logprobs.device)
            target_logprobs = logprobs.gather(1, targets[:, None])  # [rows, 1]
            token_logprobs = target_logprobs[:, 0].tolist()  # [rows]
            # Each token's rank: one more than the tokens more likely than it (vLLM's). [rows]
            ranks = ((logprobs > target_logprobs).sum(dim=-1) + 1).tolist()
            if num_top > 0:
                top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top] each
                top_values, top_ids = top_values.tolist(), top_ids.tolist()
            else:
                top_values = top_ids = [[] for _ in token_logprobs]
            results += [Logprobs(t, ids, values, rank)
                        for t, ids, values, rank in zip(token_logprobs, top_ids, top_values, ranks)]
        return results

    def _accepted(self, sample_reqs: list[ScheduledRequest], row_token_ids: list[int],
                  row_logprobs: list[Logprobs | None] | None) -> RunnerOutput:
        """The step's output from one token (and its logprobs) a sample row
        (expand_verification_rows): each request's accepted drafts and the token after them,
        and, with a proposer, the next drafts."""
        token_id_lists, logprob_lists = accept_drafts(sample_reqs, row_token_ids, row_logprobs)
        output = RunnerOutput(req_ids=[r.req_id for r in sample_reqs], sampled_token_ids=token_id_lists,
                              logprobs=logprob_lists)
        if self.proposer is not None:
            output.spec_token_ids = self._propose(sample_reqs, token_id_lists)
        return output

    def _native_loop(self, scheduler_output: SchedulerOutput) -> NativeDecodeLoop | None:
        """The native decode loop where it may take the step: one whose LoRA adapters, if it
        names any, are registered with it."""
        if self.lora_manager is not None and not self.lora_manager.all_native(scheduler_output.scheduled):
            return None
        return self.native_decode

    def _loop_lora_ids(self, scheduler_output: SchedulerOutput) -> torch.Tensor | None:
        """Each row's adapter id with the native loop (None: no row names one)."""
        if self.lora_manager is None:
            return None
        return self.lora_manager.native_ids(in_row_order(scheduler_output.scheduled))

    def _loop_samples(self, scheduler_output: SchedulerOutput, num_tokens: int, meta: AttentionMetadata,
                      sample_rows: list[ScheduledRequest]) -> bool:
        """Whether the native loop takes this step from its tokens to the next ones
        (NativeDecodeLoop.run_tokens): a step of decode rows it serves, each sampled (a
        request verifying drafts samples at each; expand_verification_rows gives each row
        the state it samples with), on the rank that samples. It samples the rows it can as
        the sampler would (Sampler.rows_in_loop); the sampler takes the others from its
        head's logits, a grammar's too, except in steps that verify drafts (whose rows share
        a request's grammar state), which stay with the sampler."""
        loop = self._native_loop(scheduler_output)
        return (loop is not None and loop.serves_tokens(num_tokens, meta) and self.is_output_rank
                and len(sample_rows) == num_tokens
                and (scheduler_output.grammar_bitmask is None or not any(r.spec_token_ids for r in sample_rows)))

    def _run_loop_tokens(self, scheduler_output: SchedulerOutput, input_ids: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata, sample_reqs: list[ScheduledRequest]) -> RunnerOutput:
        """A step _loop_samples allows, through NativeDecodeLoop.run_tokens: every row sampled in
        the loop, logprobs included (as many steps as allowed), or one step whose rows the loop
        cannot sample (Sampler.rows_in_loop; a grammar's) the sampler takes from the head's
        logits."""
        loop, sampler, vocab_size = self.native_decode, self.sampler, self.model_config.vocab_size
        in_loop = sampler.rows_in_loop(sample_reqs)
        token_bitmask, bitmask_rows = self._grammar_bitmask(scheduler_output, sample_reqs)
        for i in bitmask_rows:  # a grammar's rows: the sampler masks them first
            in_loop[i] = False
        req_ids = [r.req_id for r in sample_reqs]
        if all(in_loop):
            num_steps = self._num_loop_steps(scheduler_output.num_steps, sample_reqs)
            logprobs = sampler.token_logprobs(sample_reqs, num_steps)
            token_ids = loop.run_tokens(input_ids, positions, meta, num_steps,
                                        self._stop_token_ids(sample_reqs) if num_steps > 1 else None,
                                        sampler.token_sampling(sample_reqs, num_steps), logprobs=logprobs,
                                        history=sampler.token_history(sample_reqs, vocab_size),
                                        lora_ids=self._loop_lora_ids(scheduler_output))
            return RunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids.tolist(),
                                logprobs=None if logprobs is None
                                else sampler.loop_logprobs(logprobs, token_ids.shape[1]))
        head_logits = torch.empty((input_ids.shape[0], loop.head_outputs), dtype=self.dtype)
        logprobs = sampler.token_logprobs(sample_reqs, 1, in_loop)
        token_ids = loop.run_tokens(input_ids, positions, meta, 1, None,
                                    sampler.token_sampling(sample_reqs, 1, in_loop), head_logits, logprobs,
                                    sampler.token_history(sample_reqs, vocab_size, in_loop),
                                    self._loop_lora_ids(scheduler_output))
        return self._sample_rows_left(sample_reqs, in_loop, token_ids, head_logits, token_bitmask, bitmask_rows,
                                      None if logprobs is None else sampler.loop_logprobs(logprobs, 1))

    def _sample_rows_left(self, sample_reqs: list[ScheduledRequest], in_loop: list[bool], loop_token_ids: torch.Tensor,
                          head_logits: torch.Tensor, token_bitmask: torch.Tensor | None, bitmask_rows: list[int],
                          loop_logprobs: list[list[Logprobs] | None] | None) -> RunnerOutput:
        """One step's output where the loop sampled the rows in_loop marks (loop_token_ids
        [num_rows, 1], loop_logprobs: their logprobs, None where none reports any) and left the
        others to the sampler, which takes them from the head's logits [num_rows, head outputs]
        as it would from compute_logits' (the same values), token_bitmask's row j masking
        sample row bitmask_rows[j] (one of the sampler's)."""
        token_ids = loop_token_ids[:, 0].tolist()
        rows = [i for i, taken in enumerate(in_loop) if not taken]
        logits = head_logits[rows, :self.model_config.vocab_size].float()  # [len(rows), vocab]
        row_of = {i: j for j, i in enumerate(rows)}
        sampled = self.sampler(logits, [sample_reqs[i] for i in rows], token_bitmask,
                               [row_of[i] for i in bitmask_rows])
        row_logprobs = loop_logprobs or [None] * len(sample_reqs)
        for j, i in enumerate(rows):
            token_ids[i] = sampled.sampled_token_ids[j]
            if sampled.logprobs is not None and sampled.logprobs[j] is not None:
                row_logprobs[i] = [sampled.logprobs[j]]
        return RunnerOutput(req_ids=[r.req_id for r in sample_reqs], sampled_token_ids=[[t] for t in token_ids],
                            logprobs=None if sampled.logprobs is None and loop_logprobs is None else row_logprobs)

    def _num_loop_steps(self, num_steps: int, sample_reqs: list[ScheduledRequest]) -> int:
        """The decode steps the loop runs back to back: as many as the scheduler allowed
        (SchedulerOutput.num_steps), as far as every request's blocks reach."""
        if num_steps > 1:
            block_size = self.block_size
            for req in sample_reqs:
                num_steps = min(num_steps, len(req.block_table) * block_size - req.start_pos)
        return max(1, num_steps)

    def _stop_token_ids(self, sample_reqs: list[ScheduledRequest]) -> list[int]:
        """Tokens that end some request (EOS unless every request ignores it, and each one's
        stop tokens): steps back to back end once every row has taken one. A row that takes
        another row's stop token only ends the steps sooner."""
        stops = set()
        for req in sample_reqs:
            stops.update(req.sampling_params.stop_token_ids)
        if not all(req.sampling_params.ignore_eos for req in sample_reqs):
            stops.update(self.model_config.eos_token_ids)
        return sorted(stops)

    def add_lora(self, lora_name: str, lora_path: str) -> None:
        """Load an adapter for the requests that name it (EngineCore.hold_lora decides which
        adapters are held); ValueError where this model cannot serve it."""
        self.lora_manager.add(lora_name, lora_path)

    def remove_lora(self, lora_name: str) -> None:
        self.lora_manager.remove(lora_name)

    def lora_names(self) -> list[str]:
        """The adapters this rank holds, sorted."""
        return sorted(self.lora_manager.adapters) if self.lora_manager is not None else []

    def check_lora(self, lora_name: str, lora_path: str) -> None:
        """ValueError where this model cannot serve the adapter; nothing is held."""
        self.lora_manager.check(lora_name, lora_path)

    def _lora_step(self, scheduled: list[ScheduledRequest], keep_rows: torch.Tensor | None):
        """The forward pass's LoRA rows (manager.step), or nothing where no adapter is served."""
        if self.lora_manager is None:
            return contextlib.nullcontext()
        # On the CPU the kept rows read back for free; _kept_rows keeps every row elsewhere.
        kept_rows = keep_rows.tolist() if keep_rows is not None and keep_rows.device.type == "cpu" else None
        return self.lora_manager.step(in_row_order(scheduled), kept_rows)

    def _kept_rows(self, scheduler_output: SchedulerOutput, num_tokens: int,
                   sample_indices: torch.Tensor) -> torch.Tensor | None:
        """The rows whose hidden states the step reads (CausalLM.forward's keep_rows): the
        sampled ones, or all where a request asks for its prompt's logprobs or a pooled
        embedding, or where adapters are served off the CPU (the last layer's adapter rows
        would be read back from the device each step: _lora_step); None off the last stage,
        where the next stage reads every row. A step that samples nothing keeps its first
        row, whose output nobody reads: an empty step would be a size the compiled code
        never ran."""
        if not self.model.is_last_stage:
            return None
        scheduled = scheduler_output.scheduled
        serves_adapters_off_cpu = self.lora_manager is not None and self.device.type != "cpu"
        if serves_adapters_off_cpu or pools(scheduled) or asks_prompt_logprobs(scheduled):
            return torch.arange(num_tokens, device=self.device)
        if sample_indices.shape[0] == 0:
            return torch.zeros(1, dtype=torch.int64, device=self.device)
        return sample_indices

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 received: torch.Tensor | None, keep_rows: torch.Tensor | None) -> torch.Tensor:
        """[num_tokens, hidden], or [len(keep_rows), hidden] where rows are kept."""
        with forward_context(meta):
            if received is None:
                return self.forward(input_ids, positions, self.kv_caches, meta, keep_rows=keep_rows)
            return self.forward(input_ids, positions, self.kv_caches, meta, hidden_states=received,
                                keep_rows=keep_rows)

    def _propose(self, sample_reqs: list[ScheduledRequest], token_id_lists: list[list[int]]) -> list[list[int]]:
        """Drafts for each sampling request's next step ([] where none was asked for)."""
        asking = [i for i, req in enumerate(sample_reqs) if req.num_drafts_to_propose > 0]
        proposals: list[list[int]] = [[] for _ in sample_reqs]
        if asking:
            drafts = self.proposer.propose([sample_reqs[i] for i in asking], [token_id_lists[i] for i in asking])
            vocab_size = self.model_config.vocab_size
            for i, draft_token_ids in zip(asking, drafts):
                # A draft outside the vocabulary would index past the embedding: cut there.
                num_valid = next((j for j, t in enumerate(draft_token_ids) if not 0 <= t < vocab_size),
                                 len(draft_token_ids))
                proposals[i] = list(draft_token_ids[:num_valid])
        return proposals

    @staticmethod
    def _grammar_bitmask(scheduler_output: SchedulerOutput, sample_reqs: list[ScheduledRequest]):
        """(bitmask, the sample rows its rows mask), or (None, []) when no row is constrained."""
        if scheduler_output.grammar_bitmask is None:
            return None, []
        row_of = {r.req_id: row for row, r in enumerate(sample_reqs)}
        return (scheduler_output.grammar_bitmask,
                [row_of[req_id] for req_id in scheduler_output.structured_output_req_ids])

    def _kv_layer_hook(self, layer_idx: int) -> None:
        self.kv_connector.wait_for_layer_load(layer_idx)
        self.kv_connector.save_kv_layer(layer_idx)

    def prepare_inputs(self, scheduled: list[ScheduledRequest]):
        """All tensors of a step, built once: decode rows (one query token each) first, then
        prefill chunks. A request verifying drafts is decode rows too, one a token, each
        seeing the keys up to its own position (every attention path writes the step's K/V
        before it attends): such a step runs where decode steps do (the native loop, CUDA
        graphs) instead of through the prefill kernels."""
        device = self.device
        decodes, prefills = split_step(scheduled)
        ordered = decodes + prefills
        bs = self.block_size
        max_blocks = max((len(r.block_table) for r in ordered), default=0)
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []  # a row's: a decode token's or a prefill chunk's
        query_lens: list[int] = []
        block_table_rows: list[list[int]] = []
        sample_indices: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        for i, req in enumerate(ordered):
            num_new = len(req.token_ids)
            table = req.block_table
            input_ids.extend(req.token_ids)
            pos_range = range(req.start_pos, req.start_pos + num_new)
            positions.extend(pos_range)
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in pos_range)
            table_row = table + [0] * (max_blocks - len(table))
            if i < len(decodes):  # a row a token
                seq_lens.extend(p + 1 for p in pos_range)
                query_lens.extend([1] * num_new)
                block_table_rows.extend([table_row] * num_new)
            else:
                seq_lens.append(req.start_pos + num_new)
                query_lens.append(num_new)
                block_table_rows.append(table_row)
            if req.do_sample:  # at the last known token and at each draft
                sample_indices.extend(range(len(input_ids) - len(req.spec_token_ids) - 1, len(input_ids)))
                sample_reqs.append(req)
        num_decodes = sum(len(r.token_ids) for r in decodes)  # decode rows, one token each
        query_start_loc = list(accumulate(query_lens, initial=0))
        ids, pos, slots, samples = upload_int_lists(
            [input_ids, positions, slot_mapping, sample_indices], torch.int64, device)
        flat_block_tables, all_seq_lens, all_query_start_loc = upload_int_lists(
            [[b for row in block_table_rows for b in row], seq_lens, query_start_loc], torch.int32, device)
        prefill_query_lens = query_lens[num_decodes:]
        prefill_seq_lens = seq_lens[num_decodes:]
        # The whole step as one ragged batch (decodes are queries of length 1); the decode
        # and prefill tensors are its rows. The CPU kernel takes the whole batch in one call
        # per layer, the other paths the two parts.
        # [num_rows, max_blocks]
        all_block_tables = flat_block_tables.view(len(block_table_rows), max_blocks) if ordered else None
        one_batch = device.type == "cpu" and bool(ordered)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=num_decodes,
            decode_block_tables=all_block_tables[:num_decodes] if decodes else None,
            decode_seq_lens=all_seq_lens[:num_decodes] if decodes else None,
            max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
            prefill_block_tables=all_block_tables[num_decodes:] if prefills else None,
            # Each decode is one token, so the prefills start at token num_decodes.
            prefill_query_start_loc=all_query_start_loc[num_decodes:] - num_decodes if prefills else None,
            prefill_seq_lens=all_seq_lens[num_decodes:] if prefills else None,
            max_prefill_query_len=max(prefill_query_lens, default=0),
            max_prefill_seq_len=max(prefill_seq_lens, default=0),
            block_tables=all_block_tables if one_batch else None,
            query_start_loc=all_query_start_loc if one_batch else None,
            seq_lens=all_seq_lens if one_batch else None,
        )
        return ids, pos, meta, samples, sample_reqs
