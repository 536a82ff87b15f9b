"""EngineCore: one loop of schedule -> execute -> update, shared by every frontend.

Prefill and decode services run this same engine; their KVTransferConfig (role
producer or consumer) gives it a KV connector whose scheduler half lives in the
Scheduler and whose worker half lives with the model runner, behind the executor.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.engine.config import EngineConfig, ModelConfig, parse_memory_size
from common.engine.device import set_num_threads
from common.engine.executor import Executor, make_executor
from common.engine.errors import LoRAAdaptersBusyError
from common.engine.executor.base import StepHandle
from common.engine.heap_retention import keep_freed_heap
from common.engine.kv_cache_manager import KVCacheManager
from common.engine.kv_connector.factory import make_scheduler_connector
from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.lora.request import LoRARequest
from common.engine.model_files import load_hf_config, resolve_model
from common.engine.outputs import EngineCoreOutput, RunnerOutput, SchedulerOutput
from common.engine.python_arenas import keep_freed_arenas
from common.engine.pooling_params import PoolingConfig, PoolingParams
from common.engine.request import Request
from common.engine.scheduler import RemoteKVReservation, Scheduler
from common.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # like vLLM's VLLM_CPU_KVCACHE_SPACE, but 1 GiB
DEFAULT_GPU_KV_CACHE_FRACTION = 0.9
# How long an engine with nothing to run waits for commands before stepping again: only
# a step hears of KV transfers that ended, so it polls faster while one is open.
IDLE_WAIT_S = 0.05
IDLE_WAIT_WITH_OPEN_TRANSFERS_S = 0.002


def num_kv_blocks(kv_cache_memory, bytes_per_block: int, free_bytes: int, device_type: str) -> int:
    """Blocks for a KV budget given as bytes (int) or a fraction of free memory (float)."""
    if kv_cache_memory is None:
        kv_cache_memory = (DEFAULT_GPU_KV_CACHE_FRACTION if device_type == "cuda"
                           else min(DEFAULT_CPU_KV_CACHE_BYTES, free_bytes // 2))
    kv_cache_memory = parse_memory_size(kv_cache_memory)
    budget = int(kv_cache_memory * free_bytes) if isinstance(kv_cache_memory, float) else kv_cache_memory
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory!r} gives {budget} bytes, less than one KV "
                         f"block ({bytes_per_block} bytes); raise --kv-cache-memory")
    return num_blocks


def resolve_max_model_len(requested: int | None, model_config: ModelConfig, num_blocks: int,
                          block_size: int, bytes_per_block: int) -> int:
    model_limit = model_config.max_position_embeddings
    capacity = num_blocks * block_size
    if requested is None:
        max_model_len = min(model_limit, capacity)
        logger.info("max_model_len=%d (model limit %d, KV pool capacity %d tokens)",
                    max_model_len, model_limit, capacity)
        return max_model_len
    if requested < 1:
        raise ValueError(f"max_model_len must be >= 1; got {requested}")
    if requested > model_limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's limit of {model_limit} "
                         f"tokens (max_position_embeddings); set --max-model-len {model_limit} or less")
    if requested > capacity:
        needed = -(-requested // block_size) * bytes_per_block
        raise ValueError(
            f"max_model_len={requested} is larger than the KV cache can hold: {capacity} tokens "
            f"({num_blocks} blocks of {block_size} tokens). Raise --kv-cache-memory to at least "
            f"{needed} bytes ({needed / (1 << 30):.2f} GiB), or lower --max-model-len to {capacity} "
            f"or less.")
    return requested


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, model_dir: Path | None = None,
                 warm_grammar_backend: bool = False):
        """model_dir: config.model already resolved (resolving a GGUF hashes the whole file).
        warm_grammar_backend: build the structured-output backend while the model loads (a
        service's first constrained requests then find it ready; elsewhere the first
        constraint builds it)."""
        self.config = config
        self.model_dir = model_dir or resolve_model(config.model)
        self.model_config = ModelConfig.from_hf_config(load_hf_config(self.model_dir))
        self.structured_output = StructuredOutputManager(self.model_dir, self.model_config.vocab_size,
                                                         tuple(self.model_config.eos_token_ids))
        # Joined before the constructor returns: a thread still importing once the service
        # serves would hold the interpreter's lock from its first requests (a first prompt
        # 342 against 94 ms, measured).
        grammar_warm_up = self.structured_output.warm_up_in_background() if warm_grammar_backend else None
        # How embeddings are made: the model's sentence-transformers config, under --pooler-config.
        self.pooling_config = PoolingConfig.from_model_dir(self.model_dir).overridden(config.pooler_config)
        # The LoRA adapters the runner holds, least recently used first.
        self._held_loras: collections.OrderedDict[str, LoRARequest] = collections.OrderedDict()
        # Each name's adapter held last: a name seeds its cached blocks' hashes, so blocks
        # computed with one adapter's weights must not serve another's of that name.
        self._lora_paths_held: dict[str, str] = {}
        # Adapters read into the runner, and those dropped for another (max_loras too small
        # for the traffic's adapters shows as evictions as high as the loads).
        self.num_lora_loads = self.num_lora_evictions = 0
        set_num_threads(config.num_threads)
        keep_freed_arenas()
        keep_freed_heap()
        self.executor = executor or make_executor(self.model_config, self.model_dir, config)
        try:
            self._start(config)
        except BaseException:  # a worker process must not outlive an engine that never started
            self.executor.shutdown()
            raise
        finally:
            if grammar_warm_up is not None:
                grammar_warm_up.join()

    def _start(self, config: EngineConfig) -> None:
        """Size and allocate the KV pool, warm the runners up, build the scheduler."""
        cache = config.cache
        bytes_per_block = self.executor.kv_bytes_per_block()
        if cache.num_blocks is None:
            cache.num_blocks = num_kv_blocks(cache.kv_cache_memory, bytes_per_block,
                                             self.executor.free_memory_bytes(),
                                             getattr(self.executor, "device_type", "cpu"))
        self.max_model_len = resolve_max_model_len(config.scheduler.max_model_len, self.model_config,
                                                   cache.num_blocks, cache.block_size, bytes_per_block)
        config.scheduler.max_model_len = self.max_model_len
        self.executor.allocate_kv_cache(cache.num_blocks)
        self.executor.collective_rpc("warm_up", (config.scheduler.max_num_seqs, self.max_model_len))
        logger.info("KV pool: %d blocks x %d tokens (%.1f MiB)", cache.num_blocks, cache.block_size,
                    cache.num_blocks * bytes_per_block / (1 << 20))
        self.kv_cache_manager = KVCacheManager(cache.num_blocks, cache.block_size,
                                               enable_prefix_caching=cache.enable_prefix_caching,
                                               num_blocks_ahead=cache.num_blocks_ahead)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, cache.block_size, self.max_model_len,
                                   kv_connector=make_scheduler_connector(config.kv_transfer, cache.block_size),
                                   speculative_config=config.speculative)
        if config.scheduler.num_scheduler_steps > 1 and not all(self.executor.collective_rpc("runs_decode_steps")):
            # Slots held for steps that never run would only crowd the pool.
            logger.info("num_scheduler_steps=%d: every decode step stays a single one here (it takes the CPU's "
                        "native decode loop with a greedy head: compiled, one rank)",
                        config.scheduler.num_scheduler_steps)
            self.scheduler.num_scheduler_steps = 1
        self.idle = True
        # Called on the engine thread after each step that ran something, with the
        # step's SchedulerOutput and its duration in seconds (the services' metrics).
        self.step_observer: Callable[[SchedulerOutput, float], None] | None = None
        # Called on the engine thread after every step (the services' KV event publishing).
        self.after_step: list[Callable[["EngineCore"], None]] = []
        # Called on the engine thread with each KV transfer once it ended and the blocks
        # it touched were released (waiters, metrics).
        self.kv_transfer_observers: list[Callable[[KVTransferOutcome], None]] = []
        # Extra plain-data entries merged into stats() (e.g. the KV event sequence).
        self.stats_sources: list[Callable[[], dict]] = []
        # Outputs produced between steps (by a connector-only step), delivered with the next step's.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Pipeline parallelism: batches handed to the executor whose output is not in yet,
        # oldest first (vLLM's batch queue); None when the executor runs one at a time.
        self.batch_queue: collections.deque[tuple[SchedulerOutput, StepHandle, float]] | None = (
            collections.deque() if self.executor.max_concurrent_batches > 1 else None)
        self.max_batches_in_flight = 0  # the most batches ever in flight at once (tests, stats)

    def pooling_params_for(self, params: PoolingParams | None) -> PoolingParams:
        """An embedding request's params as this model serves them (normalize resolved by its
        sentence-transformers config); ValueError where it cannot (PoolingParams.for_model)."""
        cfg = self.model_config
        return (params or PoolingParams()).for_model(cfg.hidden_size, cfg.is_matryoshka, cfg.matryoshka_dimensions,
                                                     self.pooling_config)

    def add_request(self, request: Request) -> None:
        # Before the scheduler: a constraint the backend rejects, or an adapter the runner
        # cannot load, fails with nothing allocated.
        self.hold_lora(request.lora_request)
        self.structured_output.prepare(request)
        self.scheduler.add_request(request)

    def hold_lora(self, lora: LoRARequest | None) -> None:
        """A request's LoRA adapter held on the runner (loaded on first use); when max_loras
        are held, the least recently used one no live request names is dropped first.
        ValueError where it cannot be: LoRA off, an adapter the runner refuses, all in use."""
        if lora is None:
            return
        self._check_lora_enabled(lora.lora_name)
        held = self._held_loras
        if lora.lora_name in held:
            if held[lora.lora_name].lora_path != lora.lora_path:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} is loaded from {held[lora.lora_name].lora_path}, "
                                 f"not {lora.lora_path}: one name, one adapter")
            held.move_to_end(lora.lora_name)
            return
        unused = None  # the adapter it replaces, dropped once it is loaded (a refused one changes nothing)
        if len(held) >= self.config.lora.max_loras:
            in_use = self._lora_names_in_use()
            unused = next((name for name in held if name not in in_use), None)
            if unused is None:
                raise LoRAAdaptersBusyError(f"all {len(held)} LoRA adapters held (max_loras) are in use by "
                                            f"requests; retry when one finishes, or raise max_loras")
        try:
            self.executor.collective_rpc("add_lora", (lora.lora_name, lora.lora_path))
        except Exception:
            with contextlib.suppress(Exception):  # ranks that took it before one refused drop it again
                self.executor.collective_rpc("remove_lora", (lora.lora_name,))
            raise
        self.num_lora_loads += 1
        if unused is not None:
            self.executor.collective_rpc("remove_lora", (unused,))
            del held[unused]
            self.num_lora_evictions += 1
        held[lora.lora_name] = lora
        if self._lora_paths_held.setdefault(lora.lora_name, lora.lora_path) != lora.lora_path:
            self.reset_prefix_cache()  # the name's cached blocks are another adapter's
            self._lora_paths_held[lora.lora_name] = lora.lora_path

    def load_lora(self, lora: LoRARequest) -> None:
        """Load an adapter at run time in place of any adapter held under its name, its weights
        read anew (a path may hold new weights). Blocks cached under a name served before were
        computed with other weights, and the name seeds their hashes: the prefix cache is
        emptied. Where every slot is in use the adapter is only checked (held on first use).
        LoRAAdaptersBusyError while a live request names it; ValueError for an adapter the
        runner refuses, with nothing changed."""
        self._check_lora_enabled(lora.lora_name)
        num_using = sum(1 for r in self.scheduler.requests.values() if r.lora_name == lora.lora_name)
        if num_using:
            raise LoRAAdaptersBusyError(f"LoRA adapter {lora.lora_name!r} is in use by {num_using} requests; "
                                        f"load it again once they finish")
        served_before = self._lora_paths_held.get(lora.lora_name) == lora.lora_path  # else hold_lora resets
        self.unload_lora(lora.lora_name)
        try:
            self.hold_lora(lora)
        except LoRAAdaptersBusyError:  # every slot holds another adapter in use: check it only
            self.executor.collective_rpc("check_lora", (lora.lora_name, lora.lora_path))
        if served_before:
            self.reset_prefix_cache()

    def unload_lora(self, lora_name: str) -> None:
        """Drop the adapter held under lora_name unless a live request uses it (that one is
        then dropped when its slot is next needed)."""
        if lora_name in self._held_loras and lora_name not in self._lora_names_in_use():
            self.executor.collective_rpc("remove_lora", (lora_name,))
            del self._held_loras[lora_name]

    def _check_lora_enabled(self, lora_name: str) -> None:
        if not self.config.lora.enable_lora:
            raise ValueError(f"request names LoRA adapter {lora_name!r}, but this engine serves none "
                             f"(start it with enable_lora / --enable-lora)")

    def _lora_names_in_use(self) -> set[str | None]:
        return {r.lora_name for r in self.scheduler.requests.values()}

    def reserve_remote_kv(self, request: Request) -> RemoteKVReservation | None:
        """Take a seat and blocks for a request whose prompt KV comes from outside (its
        kv_transfer_params name the transfer). On return the worker half expects the KV,
        so the sender may be told where it goes. None when no seat or blocks are free."""
        self.hold_lora(request.lora_request)
        self.structured_output.prepare(request)
        reservation = self.scheduler.reserve_remote_kv(request)
        if reservation is not None:
            self._run_kv_connector_only()
        return reservation

    def _run_kv_connector_only(self) -> None:
        scheduler_output = self.scheduler.schedule_kv_connector_only()
        runner_output = self.executor.execute_model(scheduler_output)
        self._pending_outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        self._notify_kv_transfers(runner_output.kv_transfer_outcomes)

    def abort_requests(self, req_ids: list[str]) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(req_ids)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, so the next requests compute their prompts in full
        (a benchmark that times prefills, or a model's KV gone stale). Blocks in use stay
        with their requests, no longer shared; subscribers see the hashes removed."""
        self.kv_cache_manager.reset_prefix_cache()

    def abort_all(self) -> list[EngineCoreOutput]:
        """Abort every request, finished ones still held for a KV transfer included."""
        return self.abort_requests(list(self.scheduler.requests) + list(self.scheduler.held_requests))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.scheduler.has_open_kv_transfers()

    @property
    def idle_wait_s(self) -> float:
        return IDLE_WAIT_WITH_OPEN_TRANSFERS_S if self.scheduler.has_open_kv_transfers() else IDLE_WAIT_S

    def step(self) -> list[EngineCoreOutput]:
        if self.batch_queue is not None:
            return self._step_with_batch_queue()
        started = time.perf_counter()
        scheduler_output = self._schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self._finish_step(scheduler_output, runner_output, started)

    def _schedule(self, in_flight_req_ids: frozenset[str] = frozenset(),
                  max_num_reqs: int | None = None) -> SchedulerOutput:
        scheduler_output = self.scheduler.schedule(in_flight_req_ids, max_num_reqs)
        self.structured_output.fill_bitmask(scheduler_output, self.scheduler.requests)
        # Nothing schedulable (e.g. every request waits for remote KV): callers back off.
        self.idle = scheduler_output.is_empty
        return scheduler_output

    def _finish_step(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput,
                     started: float) -> list[EngineCoreOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        self._notify_kv_transfers(runner_output.kv_transfer_outcomes)
        if self.step_observer is not None and not scheduler_output.is_empty:
            self.step_observer(scheduler_output, time.perf_counter() - started)
        for callback in self.after_step:
            callback(self)
        return outputs

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Keep up to one batch per pipeline stage in flight: schedule another while the
        queue has room (never a request already in flight), and only then wait for the
        oldest. A request's next step is scheduled once its previous output is in. Each
        batch takes an equal share of the requests (micro-batches, as SGLang's pipeline
        does), or the first would take them all and leave the other stages idle."""
        queue = self.batch_queue
        num_stages = self.executor.max_concurrent_batches
        if len(queue) < num_stages:
            started = time.perf_counter()  # as step(): a step's time includes its scheduling
            in_flight = frozenset(r.req_id for batch, _, _ in queue for r in batch.scheduled)
            share = max(1, -(-len(self.scheduler.requests) // num_stages))
            scheduler_output = self._schedule(in_flight, share)
            if not scheduler_output.is_empty or not queue:
                queue.append((scheduler_output, self.executor.execute_model_async(scheduler_output), started))
                self.max_batches_in_flight = max(self.max_batches_in_flight, len(queue))
                if not scheduler_output.is_empty and len(queue) < num_stages:
                    return []
        scheduler_output, step, started = queue.popleft()
        # Its requests may run again now: the next step is not idle unless nothing ran.
        self.idle = scheduler_output.is_empty and not queue
        return self._finish_step(scheduler_output, step.result(), started)

    def _notify_kv_transfers(self, outcomes: list[KVTransferOutcome]) -> None:
        for outcome in outcomes:
            for observer in self.kv_transfer_observers:
                try:
                    observer(outcome)
                except Exception:  # an observer's bug must not stop the engine
                    logger.exception("KV transfer observer failed for %s", outcome.req_id)

    def collective_rpc(self, method_name: str, args: tuple = ()) -> list[Any]:
        """Reach the runners (e.g. their KV connector) through the executor: plain data back."""
        return self.executor.collective_rpc(method_name, args)

    def stats(self) -> dict:
        """A plain-data snapshot of load, for heartbeats, metrics and tests."""
        stats = dict(self.scheduler.stats) | self.structured_output.stats() | self._lora_stats()
        for source in self.stats_sources:
            stats.update(source())
        return stats

    def _lora_stats(self) -> dict:
        """With LoRA on: the running and waiting requests per adapter (by name), the adapters
        held and the most that may be, and the loads and evictions so far."""
        if not self.config.lora.enable_lora:
            return {}
        scheduler = self.scheduler
        # Those whose KV comes from a prefill instance hold a seat and blocks: running, as in the load.
        holding = (*scheduler.running, *scheduler.waiting_for_remote_kv.values())
        running = collections.Counter(r.lora_name for r in holding if r.lora_name)
        waiting = collections.Counter(r.lora_name for r in scheduler.waiting if r.lora_name)
        return {"lora_requests_running": dict(running), "lora_requests_waiting": dict(waiting),
                "lora_adapters_held": len(self._held_loras), "lora_max_adapters": self.config.lora.max_loras,
                "lora_adapter_loads": self.num_lora_loads, "lora_adapter_evictions": self.num_lora_evictions}

    def shutdown(self) -> None:
        self.executor.shutdown()
