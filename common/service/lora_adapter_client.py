"""The LoRAAdapterService's typed client: what the gateway holds for an engine instance's
run-time adapter changes. gRPC errors surface as grpc.aio.AioRpcError for the caller to map."""
from __future__ import annotations

import grpc

from common.service.keepalive import KEEPALIVE_CHANNEL_OPTIONS
from common.service.registration import ServedLoRAs
from protos.pdserve.v1 import lora_adapters_pb2, lora_adapters_pb2_grpc


class LoRAAdapterClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=KEEPALIVE_CHANNEL_OPTIONS)
        self._stub = lora_adapters_pb2_grpc.LoRAAdapterServiceStub(self._channel)

    async def load(self, lora_name: str, lora_path: str, load_inplace: bool, timeout_s: float) -> ServedLoRAs:
        return _served(await self._stub.LoadLoRAAdapter(lora_adapters_pb2.LoadLoRAAdapterRequest(
            lora_name=lora_name, lora_path=lora_path, load_inplace=load_inplace), timeout=timeout_s))

    async def unload(self, lora_name: str, timeout_s: float) -> ServedLoRAs:
        return _served(await self._stub.UnloadLoRAAdapter(
            lora_adapters_pb2.UnloadLoRAAdapterRequest(lora_name=lora_name), timeout=timeout_s))

    async def close(self) -> None:
        await self._channel.close()


def _served(response: lora_adapters_pb2.LoRAAdaptersResponse) -> ServedLoRAs:
    return ServedLoRAs(tuple(response.lora_names), response.lora_names_version, dict(response.runtime_lora_paths))
