"""ErrorStatusInterceptor on a real grpc.aio server on 127.0.0.1: a ServiceError becomes
its status and message; anything else becomes INTERNAL and the server keeps serving."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc import aio

from common.service.errors import ErrorStatusInterceptor, ServiceError


async def _unary(request: bytes, context) -> bytes:
    if request == b"invalid":
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1")
    if request == b"bug":
        raise KeyError("oops")
    return b"ok:" + request


async def _stream(request: bytes, context):
    yield b"first"
    if request == b"exhausted":
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks free")
    if request == b"bug":
        raise RuntimeError("oops")
    yield b"last"


def _identity(data: bytes) -> bytes:
    return data


async def _serve() -> tuple[aio.Server, str]:
    server = aio.server(interceptors=[ErrorStatusInterceptor()])
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Errors", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_statuses_of_unary_and_streaming_handlers():
    async def scenario():
        server, address = await _serve()
        try:
            async with aio.insecure_channel(address) as channel:
                unary = channel.unary_unary("/test.Errors/Unary", _identity, _identity)
                stream = channel.unary_stream("/test.Errors/Stream", _identity, _identity)
                assert await unary(b"x") == b"ok:x"
                with pytest.raises(aio.AioRpcError) as e:
                    await unary(b"invalid")
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                               "max_tokens must be >= 1")
                with pytest.raises(aio.AioRpcError) as e:
                    await unary(b"bug")
                assert e.value.code() == grpc.StatusCode.INTERNAL and "/test.Errors/Unary" in e.value.details()

                received = []
                with pytest.raises(aio.AioRpcError) as e:
                    async for message in stream(b"exhausted"):
                        received.append(message)
                assert received == [b"first"]  # messages before the failure still arrive
                assert (e.value.code(), e.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                               "no KV blocks free")
                with pytest.raises(aio.AioRpcError) as e:
                    async for message in stream(b"bug"):
                        pass
                assert e.value.code() == grpc.StatusCode.INTERNAL
                assert [m async for m in stream(b"fine")] == [b"first", b"last"]  # still serving
        finally:
            await server.stop(None)
    asyncio.run(scenario())
