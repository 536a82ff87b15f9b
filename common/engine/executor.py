"""Executors run a scheduled step on the device(s): `execute_model(scheduler_output)`.

The in-process executor drives one ModelRunner; a multi-process executor (one
worker per tensor-parallel rank) implements the same interface.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from common.engine.config import EngineConfig, ModelConfig
from common.engine.model_runner import ModelRunner
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

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig):
        self.runner = ModelRunner(model_config, model_dir, device=config.device, dtype=config.dtype,
                                  seed=config.seed, block_size=config.cache.block_size)

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
