"""The one error type that carries a gRPC status, and the one place that turns it into one.

Code anywhere below a servicer (engine adapters, the gateway's placement, validation)
raises ServiceError with the status and a message that tells the caller what to
change; `ErrorStatusInterceptor`, installed on every server, aborts the RPC with it.
An EngineDeadError (the engine or a worker process died) is UNAVAILABLE: the request
may succeed on another instance. Anything else escaping a handler is a bug: logged
with its traceback, answered INTERNAL, and the server keeps serving. A request message
that does not parse is the caller's error, INVALID_ARGUMENT: gRPC deserializes before
any handler runs and answers UNKNOWN on its own, so the interceptor gives each handler
a deserializer that hands the failure to the handler instead.
"""
from __future__ import annotations

import asyncio
import inspect
import logging

import grpc
from grpc import aio

from common.engine.errors import EngineDeadError

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """A request failed with a gRPC status and a message that tells the caller what to change."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


class DuplicateRequestError(ValueError):
    """A request with this id is still in flight (or holds blocks) on this instance."""


class UndecodableRequest:
    """What a request message that failed to parse arrives as, in place of the message."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError, or anything a custom deserializer raises
            return UndecodableRequest(e)
    return deserialize


def _refuse_undecodable(request, method: str) -> None:
    if isinstance(request, UndecodableRequest):
        raise invalid(f"{method}: the request message is not valid protobuf "
                      f"({type(request.error).__name__}: {request.error})")


# What is not a bug though it is not a ServiceError.
EXPECTED_ERRORS = (ServiceError, EngineDeadError)


def error_status(error: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message an expected error answers with; None for a bug."""
    if isinstance(error, ServiceError):
        return error.code, error.message
    if isinstance(error, EngineDeadError):  # this instance cannot serve any more: another one can
        return grpc.StatusCode.UNAVAILABLE, str(error)
    return None


async def _abort(context: aio.ServicerContext, error: Exception, method: str) -> None:
    status = error_status(error)
    if status is not None:
        await context.abort(*status)
    logger.error("%s failed", method, exc_info=error)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {error!r}")


def _unary_response(behavior, method: str):
    async def handle(request_or_iterator, context):
        try:
            _refuse_undecodable(request_or_iterator, method)
            return await behavior(request_or_iterator, context)
        except (asyncio.CancelledError, aio.AbortError):
            raise
        except Exception as e:
            await _abort(context, e, method)
    return handle


def _stream_response(behavior, method: str):
    async def handle(request_or_iterator, context):
        try:
            _refuse_undecodable(request_or_iterator, method)
            async for response in behavior(request_or_iterator, context):
                yield response
        except (asyncio.CancelledError, aio.AbortError):
            raise
        except Exception as e:
            await _abort(context, e, method)
    return handle


class ErrorStatusInterceptor(aio.ServerInterceptor):
    """Maps what a handler raises to the RPC's status (see the module doc)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        # Only wrapped handlers check for an UndecodableRequest, so only they get the
        # tolerant deserializer (a streamed request keeps gRPC's own).
        tolerant = {"request_deserializer": _tolerant(handler.request_deserializer)} \
            if handler.request_deserializer is not None else {}
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_unary_response(handler.unary_unary, method), **tolerant)
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_unary_response(handler.stream_unary, method))
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            return handler._replace(unary_stream=_stream_response(handler.unary_stream, method), **tolerant)
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return handler._replace(stream_stream=_stream_response(handler.stream_stream, method))
        return handler
