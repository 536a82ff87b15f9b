"""The executor interface: run a scheduled step on the device(s), `execute_model(scheduler_output)`.

Everything that crosses it is plain data, so a multi-process executor can msgpack it
to its workers. An executor that can fail on its own (a worker process died) reports
it to the callbacks in `failure_observers`, from whatever thread noticed.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from common.engine.outputs import RunnerOutput, SchedulerOutput


class StepHandle:
    """A step handed to the executor; `result()` waits for its RunnerOutput."""

    def __init__(self, output: RunnerOutput | None = None):
        self._output = output

    def result(self) -> RunnerOutput:
        return self._output


class Executor(ABC):
    # Called once with the error when the executor fails outside any call (a worker died).
    failure_observers: list[Callable[[BaseException], None]]
    # Steps that may be in flight at once: a pipeline of N stages keeps N batches going.
    max_concurrent_batches: int = 1

    def add_failure_observer(self, observer: Callable[[BaseException], None]) -> None:
        if "failure_observers" not in self.__dict__:
            self.failure_observers = []
        self.failure_observers.append(observer)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Start a step and return at once where the executor can (up to
        max_concurrent_batches in flight, results in submission order); here it runs now."""
        return StepHandle(self.execute_model(scheduler_output))

    @abstractmethod
    def kv_bytes_per_block(self) -> int: ...

    @abstractmethod
    def free_memory_bytes(self) -> int: ...

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def collective_rpc(self, method_name: str, args: tuple = ()) -> list[Any]:
        """Call a runner method by name on every worker; their plain-data results, in rank order."""

    def shutdown(self) -> None:
        pass
