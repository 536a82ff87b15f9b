"""Executors run a scheduled step on the device(s): `execute_model(scheduler_output)`.

The in-process executor drives one ModelRunner; a multi-process executor (one
worker per tensor-parallel rank) implements the same interface. Everything that
crosses it is plain data, so it can be msgpack'd to worker processes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from common.engine.config import EngineConfig, ModelConfig
from common.engine.model_runner import ModelRunner
from common.engine.models.quantization import quantization_spec
from common.engine.outputs import RunnerOutput, SchedulerOutput


class Executor(ABC):
    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...

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


class InProcessExecutor(Executor):
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig):
        self.runner = ModelRunner(model_config, model_dir, device=config.device, dtype=config.dtype,
                                  seed=config.seed, block_size=config.cache.block_size,
                                  kv_transfer_config=config.kv_transfer, speculative_config=config.speculative,
                                  enforce_eager=config.enforce_eager, quantization=quantization_spec(config))

    @property
    def device_type(self) -> str:
        return self.runner.device.type

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block

    def free_memory_bytes(self) -> int:
        return self.runner.free_memory_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def collective_rpc(self, method_name: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.runner, method_name)(*args)]

    def shutdown(self) -> None:
        self.runner.shutdown()
