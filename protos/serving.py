"""What every pdserve gRPC server adds besides its own service: the standard
health-checking service (grpc.health.v1) and server reflection, so stock tools
(grpc_health_probe, grpcurl) work against any instance without the .proto files.
"""
from __future__ import annotations

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pdserve.v1 import decode_pb2, embedding_pb2, generate_pb2, lora_adapters_pb2, prefill_pb2, registry_pb2

GENERATE_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
EMBEDDING_SERVICE = embedding_pb2.DESCRIPTOR.services_by_name["EmbeddingService"].full_name
LORA_ADAPTER_SERVICE = lora_adapters_pb2.DESCRIPTOR.services_by_name["LoRAAdapterService"].full_name
REGISTRY_SERVICE = registry_pb2.DESCRIPTOR.services_by_name["RegistryService"].full_name


async def add_health_and_reflection(server: aio.Server, *service_names: str) -> health.aio.HealthServicer:
    """Register health and reflection on `server` and mark the server ("") and each
    named service SERVING. Keep the returned servicer to report NOT_SERVING later
    (`await servicer.enter_graceful_shutdown()` on shutdown)."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer
