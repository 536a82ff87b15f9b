"""One rank of MultiProcExecutor: a spawned process that builds its ModelRunner, says
ready, then runs what the broadcast queue carries and answers on its response queue.

Its one argument besides the ready pipe is msgpack bytes (WorkerSpec as plain data);
each message is msgpack too (common.engine.outputs_codec): a payload of another shape
is answered with an error and the worker goes on. A worker whose parent is gone exits;
SIGINT is ignored (the engine process decides when its workers stop).
"""
from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from common.engine.config import EngineConfig, ModelConfig
from common.engine.cpus import num_cpus_available
from common.engine.device import select_device, set_num_threads
from common.engine.distributed.message_queue import QueueHandle, ShmRingQueue
from common.engine.executor.config_codec import config_from_plain, config_to_plain
from common.engine.heap_retention import keep_freed_heap
from common.engine.outputs_codec import (
    MessageFormatError,
    SchedulerOutputDecoder,
    pack,
    runner_output_to_dict,
    unpack,
)
from common.engine.process_exit import skip_collection_at_exit
from common.engine.python_arenas import keep_freed_arenas

logger = logging.getLogger(__name__)

REQUEST_KINDS = ("execute_model", "rpc", "shutdown")


class ParentGoneError(RuntimeError):
    pass


@dataclass
class WorkerSpec:
    engine_config: EngineConfig
    model_config: ModelConfig
    model_dir: Path
    rank: int
    output_rank: int  # the rank whose execute_model output the engine uses
    broadcast: QueueHandle  # steps and calls, to every rank
    response: QueueHandle  # this rank's answers
    parent_pid: int
    dist_init_method: str | None = None  # tcp://127.0.0.1:PORT when world_size > 1
    log_level: int = logging.INFO

    def to_bytes(self) -> bytes:
        return pack({"engine_config": config_to_plain(self.engine_config),
                     "model_config": config_to_plain(self.model_config), "model_dir": str(self.model_dir),
                     "rank": self.rank, "output_rank": self.output_rank,
                     "broadcast": self.broadcast.to_dict(), "response": self.response.to_dict(),
                     "parent_pid": self.parent_pid, "dist_init_method": self.dist_init_method,
                     "log_level": self.log_level})

    @classmethod
    def from_bytes(cls, data: bytes) -> "WorkerSpec":
        plain = unpack(data, "worker spec")
        return cls(engine_config=config_from_plain(EngineConfig, plain["engine_config"]),
                   model_config=config_from_plain(ModelConfig, plain["model_config"]),
                   model_dir=Path(plain["model_dir"]), rank=plain["rank"], output_rank=plain["output_rank"],
                   broadcast=QueueHandle.from_dict(plain["broadcast"]),
                   response=QueueHandle.from_dict(plain["response"]), parent_pid=plain["parent_pid"],
                   dist_init_method=plain["dist_init_method"], log_level=plain["log_level"])


def worker_main(spec_bytes: bytes, ready_conn: Connection) -> None:
    """Process target: build, report ready (or why not) on ready_conn, serve until told to stop."""
    # Ctrl-C reaches the whole process group: the engine process drains and then stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = WorkerSpec.from_bytes(spec_bytes)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s [worker rank {spec.rank}] %(name)s: %(message)s")
    try:
        runner, requests, responses = _start(spec)
    except BaseException as e:
        ready_conn.send_bytes(pack({"ok": False, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc()}))
        ready_conn.close()
        raise SystemExit(1) from None
    ready_conn.send_bytes(pack({"ok": True, "pid": os.getpid(), "device_type": runner.device.type,
                                "kv_bytes_per_block": runner.kv_bytes_per_block}))
    ready_conn.close()
    try:
        _serve(spec, runner, requests, responses)
    except ParentGoneError:
        logger.warning("the engine process %d is gone: exiting", spec.parent_pid)
    finally:
        runner.shutdown()
        requests.close()
        responses.close()
        skip_collection_at_exit()  # the process exits next


def _start(spec: WorkerSpec):
    config = spec.engine_config
    set_num_threads(worker_num_threads(config))
    keep_freed_arenas()
    keep_freed_heap()
    parallel = config.parallel
    if parallel.world_size > 1:
        _init_distributed(spec)
    from common.engine.executor.uniproc import build_runner  # imports torch and the models
    runner = build_runner(spec.model_config, spec.model_dir, config, rank=spec.rank)
    requests = ShmRingQueue.attach(spec.broadcast, reader_rank=spec.rank)
    responses = ShmRingQueue.attach(spec.response)
    return runner, requests, responses


def worker_num_threads(config: EngineConfig) -> int | None:
    """A rank's torch threads: --num-threads where given (per process); on the CPU else an
    equal share of the CPUs for each of the world's ranks, which all run on this host (each
    taking every core, two ranks on two cores ran a third as fast); None (torch's own) on GPUs."""
    if config.num_threads is not None or config.parallel.world_size == 1 or os.environ.get("OMP_NUM_THREADS"):
        return config.num_threads  # the user's own count where given, which torch already took
    if select_device(config.device).type != "cpu":
        return None
    return max(1, num_cpus_available() // config.parallel.world_size)


def _init_distributed(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist

    from common.engine.distributed.parallel_state import initialize_model_parallel
    parallel = spec.engine_config.parallel
    device = select_device(spec.engine_config.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                            init_method=spec.dist_init_method, rank=spec.rank, world_size=parallel.world_size)
    initialize_model_parallel(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)


def _serve(spec: WorkerSpec, runner, requests: ShmRingQueue, responses: ShmRingQueue) -> None:
    decoder = SchedulerOutputDecoder()

    def parent_alive() -> None:
        if os.getppid() != spec.parent_pid:
            raise ParentGoneError(spec.parent_pid)

    while True:
        payload = requests.dequeue(abort=parent_alive)
        request = None
        try:
            request = _parse_request(payload, spec.rank)
            if request["kind"] == "shutdown":
                return
            reply = {"ok": True, "result": _handle(request, runner, decoder, spec)}
        except Exception as e:
            # A call's ValueError is its input refused (an adapter this model cannot serve):
            # the engine hears it as one, the worker is fine.
            refused = (request is not None and request["kind"] == "rpc" and isinstance(e, ValueError)
                       and not isinstance(e, MessageFormatError))
            if not isinstance(e, MessageFormatError) and not refused:
                logger.exception("rank %d failed on %s", spec.rank, type(e).__name__)
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            if refused:
                reply |= {"refused": str(e)}
        try:
            encoded = pack(reply)
        except (TypeError, ValueError) as e:  # a result that is not plain data
            encoded = pack({"ok": False, "error": f"the result is not msgpack-able: {e}", "traceback": ""})
        responses.enqueue(encoded, abort=parent_alive)


def _parse_request(payload: bytes, rank: int) -> dict:
    request = unpack(payload, f"worker rank {rank} request")
    if request.get("kind") not in REQUEST_KINDS:
        raise MessageFormatError(f"worker rank {rank} request: kind must be one of {', '.join(REQUEST_KINDS)}; "
                                 f"got {request.get('kind')!r}")
    return request


def _handle(request: dict, runner, decoder: SchedulerOutputDecoder, spec: WorkerSpec) -> Any:
    if request["kind"] == "execute_model":
        scheduler_output = decoder.decode(request["scheduler_output"])
        output = runner.execute_model(scheduler_output)
        if spec.rank == spec.output_rank:
            return runner_output_to_dict(output)
        # Other ranks report only their part of the KV transfers that ended (the executor joins them).
        return runner_output_to_dict(output)["kv_transfer_outcomes"] if output.kv_transfer_outcomes else None
    method = request.get("method")
    if not isinstance(method, str) or method.startswith("_") or not callable(getattr(runner, method, None)):
        raise MessageFormatError(f"rpc: {method!r} is not a public ModelRunner method")
    args = request.get("args") or []
    if not isinstance(args, list):
        raise MessageFormatError(f"rpc {method}: args must be a list, got {type(args).__name__}")
    return getattr(runner, method)(*args)
