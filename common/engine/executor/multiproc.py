"""The multi-process executor (backend "mp", vLLM v1's MultiProcExecutor): one spawned
worker process per rank, rank = pp_rank * tensor_parallel_size + tp_rank.

Each step goes out once on a shared-memory broadcast queue (msgpack SchedulerOutput)
and every rank answers on its own response queue; the step's RunnerOutput is the one
of the first rank of the last pipeline stage. Workers are spawned, never forked: the
engine is built before any gRPC server thread exists, but CUDA and torch's thread
pools do not survive a fork either way. A worker's arguments are msgpack bytes and the
ready pipe, nothing else.

A monitor thread waits on the workers' sentinels: when one dies, the executor fails
with ExecutorFailedError naming the rank, every waiting call raises it, and the
failure observers hear of it (the async engine, and through it the service's health).
Shutdown (also at interpreter exit) stops the workers, kills any that linger, and
unlinks every shared-memory segment.
"""
from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import socket
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path
from typing import Any

from common.engine.config import EngineConfig, ModelConfig
from common.engine.distributed.message_queue import ShmRingQueue
from common.engine.errors import ExecutorFailedError
from common.engine.executor.base import Executor, StepHandle
from common.engine.executor.worker_proc import WorkerSpec, worker_main
from common.engine.kv_connector.metadata import KVTransferOutcome
from common.engine.kv_connector.outcome_aggregator import KVOutcomeAggregator
from common.engine.outputs import RunnerOutput, SchedulerOutput
from common.engine.outputs_codec import SchedulerOutputEncoder, pack, runner_output_from_dict, unpack

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading (and on CUDA, initialising) a large model takes minutes
SHUTDOWN_TIMEOUT_S = 5.0


class WorkerError(RuntimeError):
    """A call failed inside a worker (its traceback is in the message); the worker lives on."""


class WorkerRefusedError(WorkerError, ValueError):
    """A call's input refused by a worker (its ValueError's message, as one process would say)."""


class _PendingStep(StepHandle):
    """A step broadcast to the workers whose replies are not read yet; they are read in
    submission order, so result() first collects every older step's."""

    def __init__(self, executor: "MultiProcExecutor"):
        super().__init__()
        self._executor = executor
        self.error: BaseException | None = None
        self.done = False

    def result(self) -> RunnerOutput:
        self._executor._collect_until(self)
        if self.error is not None:
            raise self.error
        return self._output


def output_rank(tensor_parallel_size: int, pipeline_parallel_size: int) -> int:
    """The first rank of the last pipeline stage: it holds the step's sampled tokens."""
    return (pipeline_parallel_size - 1) * tensor_parallel_size


def check_parallel_support(config: EngineConfig) -> None:
    """What does not run split over ranks: refused at start rather than wrong later."""
    config.parallel.check_supports(config.kv_transfer, config.speculative)


def _raise_worker_error(replies: list[dict]) -> None:
    for rank, reply in enumerate(replies):
        if not reply.get("ok") and isinstance(reply.get("refused"), str):
            raise WorkerRefusedError(reply["refused"])
        if not reply.get("ok"):
            raise WorkerError(f"worker rank {rank}: {reply.get('error')}\n{reply.get('traceback', '')}")


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Resources:
    """What must not outlive the executor; released by shutdown or at interpreter exit."""

    def __init__(self) -> None:
        self.processes: list[multiprocessing.Process] = []
        self.queues: list[ShmRingQueue] = []
        self.stop_monitor_r, self.stop_monitor_w = os.pipe()
        self.monitor_started = False
        self.asked_to_stop = False  # the workers were sent "shutdown": give them time to exit

    def release(self) -> None:
        """Stop the monitor, end the workers (waiting a while for those asked to stop), unlink."""
        try:
            os.write(self.stop_monitor_w, b"x")
        except OSError:  # the monitor already left (a worker died)
            pass
        os.close(self.stop_monitor_w)
        if not self.monitor_started:
            os.close(self.stop_monitor_r)
        deadline = time.monotonic() + (SHUTDOWN_TIMEOUT_S if self.asked_to_stop else 0.0)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                if self.asked_to_stop:
                    logger.warning("worker %s did not stop in %.0fs: terminating it", process.name,
                                   SHUTDOWN_TIMEOUT_S)
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
        for queue in self.queues:
            queue.close()


class MultiProcExecutor(Executor):
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig,
                 ready_timeout_s: float = READY_TIMEOUT_S):
        check_parallel_support(config)
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.output_rank = output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.failure_observers = []
        # Every rank decodes every step, so one encoder's idea of what they hold is theirs.
        self._step_encoder = SchedulerOutputEncoder()
        # Each rank moves its shard of a request's KV: the transfer ends when all did.
        self._kv_outcomes = KVOutcomeAggregator(self.world_size)
        # A pipeline keeps one batch per stage going; their replies come back in order.
        self.max_concurrent_batches = parallel.pipeline_parallel_size
        self._in_flight: collections.deque[_PendingStep] = collections.deque()
        self._failure: ExecutorFailedError | None = None
        self._shutting_down = False
        self._lock = threading.Lock()  # one call in flight: the queues are read and written in order
        self._resources = _Resources()
        self._finalizer = weakref.finalize(self, self._resources.release)
        try:
            self._start(model_config, model_dir, config, ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch_workers, name="executor-monitor", daemon=True)
        self._monitor.start()
        self._resources.monitor_started = True

    # ---- start ----
    def _start(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig, ready_timeout_s: float):
        resources = self._resources
        self.broadcast = ShmRingQueue.create(num_readers=self.world_size)
        resources.queues.append(self.broadcast)
        self.responses = [ShmRingQueue.create(num_readers=1, num_slots=max(4, config.parallel.pipeline_parallel_size))
                          for _ in range(self.world_size)]
        resources.queues += self.responses
        for queue in self.responses:
            queue.reader_rank = 0
        init_method = f"tcp://127.0.0.1:{_free_tcp_port()}" if self.world_size > 1 else None
        context = multiprocessing.get_context("spawn")
        ready_conns = []
        for rank in range(self.world_size):
            spec = WorkerSpec(engine_config=config, model_config=model_config, model_dir=Path(model_dir), rank=rank,
                              output_rank=self.output_rank, broadcast=self.broadcast.handle,
                              response=self.responses[rank].handle, parent_pid=os.getpid(),
                              dist_init_method=init_method, log_level=logging.getLogger().getEffectiveLevel())
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=worker_main, args=(spec.to_bytes(), writer),
                                      name=f"pdserve-worker-rank{rank}", daemon=True)
            process.start()
            writer.close()
            resources.processes.append(process)
            ready_conns.append(reader)
        self.workers = self._wait_ready(ready_conns, time.monotonic() + ready_timeout_s)
        self.device_type = self.workers[0]["device_type"]
        logger.info("executor mp: %d worker(s), pids %s, shared memory %s", self.world_size, self.worker_pids,
                    " ".join(self.shm_names))

    def _wait_ready(self, ready_conns: list, deadline: float) -> list[dict]:
        processes = self._resources.processes
        ready: dict[int, dict] = {}
        pending = dict(enumerate(ready_conns))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"worker rank {min(pending)} did not come up within the deadline "
                                   f"(ranks not ready: {sorted(pending)})")
            waitables = list(pending.values()) + [processes[rank].sentinel for rank in pending]
            wait_for_connections(waitables, timeout=remaining)
            for rank, conn in list(pending.items()):
                if conn.poll():
                    try:
                        message = unpack(conn.recv_bytes(), f"worker rank {rank} ready message")
                    except EOFError:
                        message = None
                    if message is None or not message.get("ok"):
                        processes[rank].join(5.0)
                        why = (f"{message['error']}\n{message['traceback']}" if message else
                               "it exited before reporting; its error is on stderr (e.g. a __main__ module read "
                               "from stdin, which a spawned worker cannot import again)")
                        raise RuntimeError(f"worker rank {rank} failed to start (exit code "
                                           f"{processes[rank].exitcode}): {why}")
                    ready[rank] = message
                    del pending[rank]
                elif not processes[rank].is_alive():
                    raise RuntimeError(f"worker rank {rank} died before it was ready "
                                       f"(exit code {processes[rank].exitcode})")
        return [ready[rank] for rank in range(self.world_size)]

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._resources.processes]

    @property
    def shm_names(self) -> list[str]:
        return [queue.name for queue in self._resources.queues]

    # ---- failure ----
    def _watch_workers(self) -> None:
        processes = self._resources.processes
        sentinels = {process.sentinel: rank for rank, process in enumerate(processes)}
        stop = self._resources.stop_monitor_r
        try:
            ready = wait_for_connections([*sentinels, stop])
        finally:
            os.close(stop)
        if self._shutting_down or stop in ready:
            return
        rank = min(sentinels[s] for s in ready if s in sentinels)
        process = processes[rank]
        process.join(0.5)  # for its exit code
        self._fail(ExecutorFailedError(f"worker rank {rank} (pid {process.pid}) died with exit code "
                                       f"{process.exitcode}"))

    def _fail(self, error: ExecutorFailedError) -> None:
        if self._failure is not None:
            return
        self._failure = error
        logger.error("executor failed: %s", error)
        for observer in list(self.failure_observers):
            try:
                observer(error)
            except Exception:
                logger.exception("executor failure observer failed")

    def _check_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    @property
    def failed(self) -> ExecutorFailedError | None:
        return self._failure

    # ---- calls ----
    def _call(self, request: dict) -> list[dict]:
        """Broadcast one request, then every rank's reply in rank order (after the replies
        of any step still in flight)."""
        with self._lock:
            self._broadcast(request)
            self._read_in_flight()
            replies = self._read_replies()
        _raise_worker_error(replies)
        return replies

    def _broadcast(self, request: dict) -> None:
        self._check_failed()
        if self._shutting_down:
            raise ExecutorFailedError("the executor was shut down")
        self.broadcast.enqueue(pack(request), abort=self._check_failed)

    def _read_replies(self) -> list[dict]:
        return [unpack(queue.dequeue(abort=self._check_failed), f"worker rank {rank} reply")
                for rank, queue in enumerate(self.responses)]

    def _read_in_flight(self, until: _PendingStep | None = None) -> None:
        """Read the replies of steps in flight, oldest first, up to `until` (default: all)."""
        while self._in_flight and (until is None or not until.done):
            step = self._in_flight.popleft()
            try:
                replies = self._read_replies()
                _raise_worker_error(replies)
                step._output = self._runner_output(replies)
            except Exception as e:  # the step's caller hears of it
                step.error = e
            step.done = True

    def _collect_until(self, step: _PendingStep) -> None:
        with self._lock:
            self._read_in_flight(until=step)

    def send_raw(self, payload: bytes) -> list[dict]:
        """Broadcast `payload` as is and return the replies (tests: a malformed request)."""
        with self._lock:
            self._read_in_flight()
            self._check_failed()
            self.broadcast.enqueue(payload, abort=self._check_failed)
            return self._read_replies()

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Broadcast the step and return; the caller keeps at most max_concurrent_batches in flight."""
        step = _PendingStep(self)
        with self._lock:
            self._broadcast({"kind": "execute_model", "scheduler_output": self._step_encoder.encode(scheduler_output)})
            self._in_flight.append(step)
        return step

    def _runner_output(self, replies: list[dict]) -> RunnerOutput:
        output = runner_output_from_dict(replies[self.output_rank]["result"])
        parts = [output.kv_transfer_outcomes if rank == self.output_rank else
                 [KVTransferOutcome(**o) for o in reply["result"] or []] for rank, reply in enumerate(replies)]
        if any(parts):
            output.kv_transfer_outcomes = self._kv_outcomes.add(parts)
            output.finished_sending = [o.req_id for o in output.kv_transfer_outcomes if o.direction == "send"]
            output.finished_recving = [o.req_id for o in output.kv_transfer_outcomes if o.direction == "recv"]
            output.failing_kv_transfers = {o.req_id: f"tensor-parallel rank part: {o.reason}"
                                           for rank_parts in parts for o in rank_parts if not o.ok}
        return output

    def collective_rpc(self, method_name: str, args: tuple = ()) -> list[Any]:
        return [reply["result"] for reply in self._call({"kind": "rpc", "method": method_name, "args": list(args)})]

    def kv_bytes_per_block(self) -> int:
        return max(worker["kv_bytes_per_block"] for worker in self.workers)

    def free_memory_bytes(self) -> int:
        return min(self.collective_rpc("free_memory_bytes"))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("allocate_kv_cache", (num_blocks,))

    # ---- shutdown ----
    def shutdown(self) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        # A call stuck on a hung worker holds the lock: then the workers are terminated instead.
        if self._failure is None and hasattr(self, "workers") and self._lock.acquire(timeout=1.0):
            try:
                self.broadcast.enqueue(pack({"kind": "shutdown"}), abort=self._check_failed, timeout=1.0)
                self._resources.asked_to_stop = True
            except Exception as e:  # a worker died or hangs: release() ends it
                logger.warning("could not ask the workers to stop: %s", e)
            finally:
                self._lock.release()
        self._finalizer()
