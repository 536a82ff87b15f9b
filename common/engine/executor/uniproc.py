"""The in-process executor: one ModelRunner in the engine's own process (backend "uni")."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from common.engine.config import EngineConfig, ModelConfig
from common.engine.executor.base import Executor
from common.engine.model_runner import ModelRunner
from common.engine.models.quantization import quantization_spec
from common.engine.outputs import RunnerOutput, SchedulerOutput


def build_runner(model_config: ModelConfig, model_dir: Path, config: EngineConfig, rank: int = 0) -> ModelRunner:
    """The runner of one rank; the parallel layout is passed only when there is one to split over."""
    parallel = {"parallel_config": config.parallel, "rank": rank} if config.parallel.world_size > 1 else {}
    return ModelRunner(model_config, model_dir, device=config.device, dtype=config.dtype,
                       seed=config.seed, block_size=config.cache.block_size,
                       kv_cache_dtype=config.cache.cache_dtype,
                       kv_transfer_config=config.kv_transfer, speculative_config=config.speculative,
                       enforce_eager=config.enforce_eager, quantization=quantization_spec(config),
                       single_weight_copy=config.single_weight_copy,
                       num_prefill_threads=config.num_prefill_threads, lora_config=config.lora, **parallel)


class InProcessExecutor(Executor):
    def __init__(self, model_config: ModelConfig, model_dir: Path, config: EngineConfig):
        self.runner = build_runner(model_config, model_dir, config)

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
