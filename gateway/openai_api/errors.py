"""Errors of the OpenAI-compatible API: OpenAI's body shape, HTTP codes that match
the gateway's gRPC statuses.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": "invalid_value"}}

ApiError is raised by request parsing (400 naming the field, 404 for a model that is
not served, 413 for a body over the limit); a ServiceError from the shared request
path becomes one through `from_gateway_error`, with the status its gRPC code maps to.
"""
from __future__ import annotations

import json

import grpc

from common.service.errors import ServiceError

# gRPC status -> HTTP status; anything else is a 500.
HTTP_STATUS_BY_GRPC_CODE = {
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# What a refusal made at the HTTP edge (before the gateway saw the request) is counted
# as in pdserve_requests_total, so HTTP and gRPC refusals share one set of labels.
GRPC_CODE_BY_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                            404: grpc.StatusCode.NOT_FOUND,
                            413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                            503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
ERROR_TYPE_BY_HTTP_STATUS = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             405: "invalid_request_error", 413: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable_error",
                             504: "timeout_error"}


class ApiError(Exception):
    """A request answered with an HTTP error status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, grpc_code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.status = status
        # The status the request is counted under (metrics): the gateway's own when it
        # answered, else the one the HTTP status stands for.
        self.grpc_code = grpc_code or GRPC_CODE_BY_HTTP_STATUS.get(status, grpc.StatusCode.INTERNAL)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s  # sent as Retry-After (whole seconds)

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPE_BY_HTTP_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def body_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def invalid_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 whose message starts with the field's name."""
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def from_gateway_error(error: ServiceError, param: str | None = None) -> ApiError:
    return ApiError(HTTP_STATUS_BY_GRPC_CODE.get(error.code, 500), error.message, param=param,
                    code=error.code.name.lower(), retry_after_s=getattr(error, "retry_after_s", None),
                    grpc_code=error.code)
