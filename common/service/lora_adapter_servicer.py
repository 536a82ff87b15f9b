"""gRPC face of an engine instance's LoRA adapters (pdserve.v1.LoRAAdapterService), which
prefill and decode instances both serve: adapters loaded and unloaded at run time, each
change one new version of the names the instance's heartbeats report.

RPC status codes:
  LoadLoRAAdapter    INVALID_ARGUMENT     no name or path; an adapter this model cannot serve
                     ALREADY_EXISTS       the name is served and load_inplace is false
                     FAILED_PRECONDITION  the instance runs without --enable-lora
                     RESOURCE_EXHAUSTED   requests in flight use the name (retry when they finish)
  UnloadLoRAAdapter  NOT_FOUND            the instance does not serve the name
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from common.engine.async_engine import AsyncEngine
from common.service.engine_requests import refused
from common.service.errors import ServiceError, invalid
from common.service.lora_modules import LoRAModules
from protos.pdserve.v1 import lora_adapters_pb2, lora_adapters_pb2_grpc

logger = logging.getLogger(__name__)


class LoRAAdapterServicer(lora_adapters_pb2_grpc.LoRAAdapterServiceServicer):
    def __init__(self, engine: AsyncEngine, lora_modules: LoRAModules, lora_enabled: bool):
        self.engine = engine
        self.lora_modules = lora_modules
        self.lora_enabled = lora_enabled
        self._changing = asyncio.Lock()  # one change at a time: versions follow the order of changes

    async def LoadLoRAAdapter(self, request: lora_adapters_pb2.LoadLoRAAdapterRequest,
                              context) -> lora_adapters_pb2.LoRAAdaptersResponse:
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise invalid("both lora_name and lora_path must be given")
        if not self.lora_enabled:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this instance runs without LoRA: start it with --enable-lora to load adapters")
        async with self._changing:
            if name in self.lora_modules and not request.load_inplace:
                raise ServiceError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"LoRA adapter {name!r} is already loaded; set load_inplace to replace it")
            lora = self.lora_modules.new_request(name, path)
            try:
                await self.engine.call(lambda core: core.load_lora(lora))
            except ValueError as e:
                raise refused(e) from None
            self.lora_modules.add(lora)
            logger.info("loaded LoRA adapter %r from %s", name, path)
            return self._served()

    async def UnloadLoRAAdapter(self, request: lora_adapters_pb2.UnloadLoRAAdapterRequest,
                                context) -> lora_adapters_pb2.LoRAAdaptersResponse:
        name = request.lora_name
        async with self._changing:
            if name not in self.lora_modules:
                raise ServiceError(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not served here")
            self.lora_modules.remove(name)  # refused from now on; those in flight finish with it
            await self.engine.call(lambda core: core.unload_lora(name))
            logger.info("unloaded LoRA adapter %r", name)
            return self._served()

    def _served(self) -> lora_adapters_pb2.LoRAAdaptersResponse:
        return lora_adapters_pb2.LoRAAdaptersResponse(lora_names=self.lora_modules.names,
                                                      lora_names_version=self.lora_modules.version,
                                                      runtime_lora_paths=self.lora_modules.runtime_paths)
