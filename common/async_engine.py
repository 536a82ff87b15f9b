"""An asyncio front for EngineCore: the engine loop runs on its own thread.

`generate(request)` is an async iterator of EngineCoreOutput; cancelling the
consuming task, or closing the iterator early, aborts the request and frees
its blocks. `call(fn)` runs fn(engine_core) on the engine thread between steps,
which is how the services reach role-specific scheduler hooks safely.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.engine import EngineCore
from common.outputs import EngineCoreOutput
from common.request import Request

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # req_id -> (event loop, queue) of the consumer; touched on both threads under the lock.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._dead: BaseException | None = None
        self.stats: dict[str, Any] = self._collect_stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- consumer side (any event loop) ----
    async def generate(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.req_id in self._streams:
                raise ValueError(f"request id {request.req_id!r} is already in flight")
            self._streams[request.req_id] = (asyncio.get_running_loop(), out_queue)
        self._commands.put(("add", request))
        finished = False
        try:
            while True:
                item = await out_queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request.req_id, None)
            if not finished:
                self._commands.put(("abort", [request.req_id]))

    def abort(self, req_ids: list[str]) -> None:
        self._commands.put(("abort", list(req_ids)))

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Run fn(core) on the engine thread and return its result."""
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        return await future

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("wake", None))
        self._thread.join(timeout)
        self.core.shutdown()

    # ---- engine thread ----
    def _loop(self) -> None:
        try:
            while not self._stopping:
                idle = not self.core.has_unfinished_requests() or self.core.idle
                self._apply_commands(block=idle)
                if self._stopping:
                    break
                if self.core.has_unfinished_requests():
                    self._dispatch(self.core.step())
                    self.stats = self._collect_stats()
        except BaseException as exc:  # never leave consumers waiting on a dead loop
            logger.exception("engine loop died")
            self._dead = exc
            with self._lock:
                streams = list(self._streams.values())
            for loop, out_queue in streams:
                loop.call_soon_threadsafe(out_queue.put_nowait, EngineDeadError(f"engine loop died: {exc!r}"))

    def _apply_commands(self, block: bool) -> None:
        commands = []
        try:
            # Block briefly when idle so shutdown and remote-KV arrivals are noticed.
            commands.append(self._commands.get(timeout=0.05) if block else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        for kind, payload in commands:
            if kind == "add":
                try:
                    self.core.add_request(payload)
                except Exception as exc:  # a bad request fails alone
                    self._send(payload.req_id, exc)
            elif kind == "abort":
                self._dispatch(self.core.abort_requests(payload))
            elif kind == "call":
                fn, future = payload
                try:
                    result = fn(self.core)
                except Exception as exc:
                    future.get_loop().call_soon_threadsafe(_set_exception, future, exc)
                else:
                    future.get_loop().call_soon_threadsafe(_set_result, future, result)
        if commands:
            self.stats = self._collect_stats()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            self._send(out.req_id, out)

    def _send(self, req_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(req_id)
        if target is not None:
            loop, out_queue = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)

    def _collect_stats(self) -> dict[str, Any]:
        return self.core.stats()


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
