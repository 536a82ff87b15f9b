"""An asyncio front for EngineCore: the engine loop runs on its own thread.

`generate(request)` is an async iterator of EngineCoreOutput; cancelling the
consuming task, or closing the iterator early, aborts the request and frees
its blocks. `call(fn)` runs fn(engine_core) on the engine thread between steps,
which is how the services reach the scheduler's remote-KV calls safely.

For requests admitted by such a hook rather than by `generate` (the decode role
reserves blocks for remote KV first), `open_stream(req_id)` registers the output
stream before the hook runs, so no output can be missed; `call(fn, deliver=True)`
and `post(fn)` send the EngineCoreOutputs fn returns to their streams.

When the engine dies (a step raised, or the executor reports a dead worker while the
loop idles) every open stream and pending `call` fails with EngineDeadError, later
ones fail at once, and `death_observers` hear of it (the service's health).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from common.engine.engine_core import EngineCore
from common.engine.errors import EngineDeadError, RequestIdReleasingError
from common.engine.outputs import EngineCoreOutput
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, core: EngineCore):
        self.core = core
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # req_id -> (event loop, queue) of the consumer; touched on both threads under the lock.
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Ids whose stream closed before the request finished, until the engine no longer
        # holds that request: a new stream of the id would receive its last outputs.
        self._releasing_ids: set[str] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._dead: BaseException | None = None
        # Called once, on the engine thread, with the error that killed the loop.
        self.death_observers: list[Callable[[BaseException], None]] = []
        # Called on the engine thread with each output that ends a request (it carries the
        # request's RequestTimings), before its stream gets it: the service's metrics.
        self.finished_observers: list[Callable[[EngineCoreOutput], None]] = []
        # A dead worker must wake an idle loop: it would otherwise only notice at the next step.
        core.executor.add_failure_observer(lambda exc: self._commands.put(("failed", exc)))
        self.stats: dict[str, Any] = self._collect_stats()
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- consumer side (any event loop) ----
    async def generate(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        stream = self.open_stream(request.req_id)
        try:
            self._commands.put(("add", request))
            async for item in stream:
                yield item
        finally:
            stream.close()

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile params' constraint on a worker thread, so that admission on the engine
        loop finds it cached and a slow schema does not stall the other requests.
        ValueError naming the field when the grammar backend rejects it."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.core.structured_output.compile, params)

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine loop; None while it runs."""
        return self._dead

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine loop died: {self._dead!r}")

    def open_stream(self, req_id: str) -> "RequestStream":
        """Register the output stream of req_id now, on the caller's event loop.
        Close it (or use it as a context manager) when done: closing before the
        request finished aborts it."""
        out_queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._dead is not None:
                raise self._dead_error()
            if req_id in self._streams:
                raise ValueError(f"request id {req_id!r} is already in flight")
            if req_id in self._releasing_ids:
                raise RequestIdReleasingError(f"request id {req_id!r} is still being released: its earlier "
                                              f"request was cancelled and has not ended yet")
            self._streams[req_id] = (asyncio.get_running_loop(), out_queue)
        return RequestStream(self, req_id, out_queue)

    def _close_stream(self, stream: "RequestStream") -> None:
        with self._lock:
            if self._streams.get(stream.req_id, (None, None))[1] is stream._queue:
                del self._streams[stream.req_id]
            if not stream.finished:
                self._releasing_ids.add(stream.req_id)
        if not stream.finished:
            self._commands.put(("abort", [stream.req_id]))

    def abort(self, req_ids: list[str]) -> None:
        self._commands.put(("abort", list(req_ids)))

    async def call(self, fn: Callable[[EngineCore], Any], *, deliver: bool = False) -> Any:
        """Run fn(core) on the engine thread and return its result. With deliver=True
        fn returns a list of EngineCoreOutput, which also go to their streams."""
        if self._dead is not None:
            raise self._dead_error()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future, deliver)))
        if self._dead is not None:  # died meanwhile: its drain may have run before our put
            self._fail_pending_calls()
        return await future

    def post(self, fn: Callable[[EngineCore], list[EngineCoreOutput] | None]) -> None:
        """Thread-safe, fire and forget: run fn(core) on the engine thread between steps
        and send the EngineCoreOutputs it returns to their streams. For callbacks from
        other threads (a KV transfer ended) that must touch the scheduler."""
        self._commands.put(("post", fn))

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
                if self._releasing_ids:
                    self._forget_released_ids()
        except BaseException as exc:  # never leave consumers waiting on a dead loop
            logger.exception("engine loop died")
            with self._lock:
                self._dead = exc
                streams = list(self._streams.values())
            for loop, out_queue in streams:
                loop.call_soon_threadsafe(out_queue.put_nowait, self._dead_error())
            self._fail_pending_calls()
            for observer in self.death_observers:
                try:
                    observer(exc)
                except Exception:
                    logger.exception("engine death observer failed")

    def _forget_released_ids(self) -> None:
        scheduler = self.core.scheduler
        with self._lock:
            self._releasing_ids = {req_id for req_id in self._releasing_ids
                                   if req_id in scheduler.requests or req_id in scheduler.held_requests}

    def _fail_pending_calls(self) -> None:
        """Any thread, once dead: answer every queued `call` with the death."""
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "call":
                future = payload[1]
                future.get_loop().call_soon_threadsafe(_set_exception, future, self._dead_error())

    def _apply_commands(self, block: bool) -> None:
        commands = []
        try:
            # Block briefly when idle so shutdown and remote-KV arrivals are noticed.
            commands.append(self._commands.get(timeout=self.core.idle_wait_s) if block
                            else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        for i, (kind, payload) in enumerate(commands):
            if kind == "failed":
                for later in commands[i + 1:]:  # the death answers them (_fail_pending_calls)
                    self._commands.put(later)
                raise payload
            if kind == "add":
                try:
                    self.core.add_request(payload)
                except Exception as exc:  # a bad request fails alone
                    self._send(payload.req_id, exc)
            elif kind == "abort":
                self._dispatch(self.core.abort_requests(payload))
            elif kind == "call":
                fn, future, deliver = payload
                try:
                    result = fn(self.core)
                except Exception as exc:
                    future.get_loop().call_soon_threadsafe(_set_exception, future, exc)
                else:
                    if deliver:
                        self._dispatch(result)
                    future.get_loop().call_soon_threadsafe(_set_result, future, result)
            elif kind == "post":
                try:
                    self._dispatch(payload(self.core) or [])
                except Exception:  # nobody awaits a post: log, and keep the loop alive
                    logger.exception("posted engine callback failed")
        if commands:
            self.stats = self._collect_stats()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.timings is not None:
                self._observe_finished(out)
            self._send(out.req_id, out)

    def _observe_finished(self, out: EngineCoreOutput) -> None:
        for observer in self.finished_observers:
            try:
                observer(out)
            except Exception:  # an observer's bug must not stop the engine
                logger.exception("finished-request observer failed for %s", out.req_id)

    def _send(self, req_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(req_id)
        if target is not None:
            loop, out_queue = target
            loop.call_soon_threadsafe(out_queue.put_nowait, item)

    def _collect_stats(self) -> dict[str, Any]:
        return self.core.stats()


class RequestStream:
    """The outputs of one request, in order; ends after the finished one. An engine
    error (request rejected, loop died) is raised from the iteration."""

    def __init__(self, engine: AsyncEngine, req_id: str, out_queue: asyncio.Queue):
        self.req_id = req_id
        self.finished = False
        self._engine = engine
        self._queue = out_queue
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> EngineCoreOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Stop listening; aborts the request unless it already finished. Idempotent."""
        if not self._closed:
            self._closed = True
            self._engine._close_stream(self)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
