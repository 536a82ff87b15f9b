"""Executors run a scheduled step on the device(s): in this process ("uni") or in one
worker process per rank ("mp"); `make_executor` picks by the engine config."""
from __future__ import annotations

from pathlib import Path

from common.engine.config import EngineConfig, ModelConfig
from common.engine.errors import ExecutorFailedError
from common.engine.executor.base import Executor
from common.engine.executor.uniproc import InProcessExecutor

__all__ = ["Executor", "ExecutorFailedError", "InProcessExecutor", "make_executor"]


def make_executor(model_config: ModelConfig, model_dir: Path, config: EngineConfig) -> Executor:
    backend = config.parallel.executor_backend
    if backend == "mp":
        from common.engine.executor.multiproc import MultiProcExecutor
        return MultiProcExecutor(model_config, model_dir, config)
    return InProcessExecutor(model_config, model_dir, config)
