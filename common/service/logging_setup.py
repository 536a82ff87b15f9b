"""Logging of every pdserve service: one line per record on stderr, as text or JSON,
each carrying the id of the request it is about.

    configure_logging("decode", instance_id, level="INFO", log_format="json")
    with request_context(req_id):          # at an RPC's entry: every line inside carries it
        log_event(logger, "request end", status="OK", output_tokens=12, duration_s=0.41)

The request id is the gateway's (PreparedRequest.request_id), which the gateway sends to
the decode instance and the decode instance to the prefill instance, so one grep (or one
`jq 'select(.request_id == "...")'`) follows a request through all three. It lives in a
ContextVar: gRPC's asyncio server runs each RPC in a task of its own (with a copy of the
context), so setting it at the RPC's entry labels that RPC's lines and nothing else, and
tasks the RPC starts inherit it.

JSON lines (`--log-format json`): {"ts", "level", "role", "instance_id", "logger", "msg",
"request_id" (when known), the event's fields, "exc" (a traceback, when there is one)}.
Text lines: `TIME LEVEL ROLE [request_id] LOGGER: MSG key=value ...`.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
from grpc import aio

from common.service.errors import EXPECTED_ERRORS, error_status
from common.service.tracing import NO_TRACING, Tracing, trace_headers

LOG_FORMATS = ("text", "json")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdserve_request_id", default=None)

# Where log_event keeps its fields on the record (a name no stdlib attribute uses).
_FIELDS_ATTR = "pdserve_fields"


def add_logging_args(parser) -> None:
    """--log-level and --log-format, the same for the gateway and both workers."""
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text lines, or one JSON object per line (ts, level, role, instance_id, "
                             "logger, msg, request_id, ...)")


@contextlib.contextmanager
def request_context(request_id: str | None) -> Iterator[None]:
    """Label every log line in the block (and in tasks started from it) with request_id."""
    token = REQUEST_ID.set(request_id or None)
    try:
        yield
    finally:
        try:
            REQUEST_ID.reset(token)
        except ValueError:  # an async generator finalized from another context: nothing to undo there
            pass


def log_event(logger: logging.Logger, msg: str, level: int = logging.INFO, **fields: Any) -> None:
    """One line with structured fields: JSON keys, or `key=value` after the text message."""
    if logger.isEnabledFor(level):
        logger.log(level, msg, extra={_FIELDS_ATTR: fields})


class _RequestIdFilter(logging.Filter):
    """Copies the current request id onto the record (the formatter may run elsewhere)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__("%(asctime)s %(levelname)s " + role + "%(request_tag)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.request_tag = f" [{request_id}]" if request_id else ""
        text = super().format(record)
        fields = getattr(record, _FIELDS_ATTR, None)
        if fields:
            first, newline, rest = text.partition("\n")  # keep a traceback below the fields
            text = first + "".join(f" {k}={_text_value(v)}" for k, v in fields.items()) + newline + rest
        return text


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str, instance_id: str):
        super().__init__()
        self.role = role
        self.instance_id = instance_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                  .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname, "role": self.role, "instance_id": self.instance_id,
            "logger": record.name, "msg": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id:
            entry["request_id"] = request_id
        for key, value in (getattr(record, _FIELDS_ATTR, None) or {}).items():
            entry.setdefault(key, value)  # never let a field overwrite the envelope
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            entry["exc"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def make_handler(role: str, instance_id: str, log_format: str = "text", stream=None) -> logging.Handler:
    """A handler writing `log_format` lines (to stderr by default), request ids included."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter(role, instance_id) if log_format == "json" else TextFormatter(role))
    return handler


def configure_logging(role: str, instance_id: str, level: str = "INFO", log_format: str = "text",
                      stream=None) -> logging.Handler:
    """Replace the root logger's handlers with one stderr handler in `log_format`."""
    handler = make_handler(role, instance_id, log_format, stream)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def _text_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return json.dumps(text) if (not text or " " in text or "=" in text or '"' in text) else text


class EndFields(dict):
    """The fields of a request's end line. `complete` is set once the whole answer is out:
    the caller hanging up after that (the gateway cancels a finished stream) is no failure.
    `span`: the request's trace span here (common.service.tracing), None while tracing is off."""

    complete = False
    span = None


@contextlib.contextmanager
def logged_request(log: logging.Logger, what: str, request_id: str, context: aio.ServicerContext | None = None,
                   tracing: Tracing = NO_TRACING, **start_fields) -> Iterator[EndFields]:
    """One RPC's work, labelled with its request id (common.service.logging_setup) and logged as a
    `WHAT start` line and a `WHAT end` line with status and duration_s. The caller adds
    end fields to the yielded dict; a ServiceError, an abort of `context`, cancellation or
    a bug sets the status. With tracing on, the same fields make a span named WHAT, the child
    of the trace context in the call's metadata."""
    started = time.monotonic()
    end = EndFields(status="OK")
    if tracing.enabled:
        parent = trace_headers(context.invocation_metadata()) if context is not None else None
        end.span = tracing.start(what, parent, request_id=request_id, **start_fields)
    with request_context(request_id):
        log_event(log, f"{what} start", **start_fields)
        try:
            yield end
        except EXPECTED_ERRORS as e:
            end["status"] = error_status(e)[0].name
            raise
        except BaseException as e:
            if end["status"] == "OK" and not end.complete:
                aborted = context.code() if context is not None else None  # context.abort raises too
                end["status"] = (aborted.name if isinstance(aborted, grpc.StatusCode)
                                 else "CANCELLED" if isinstance(e, (asyncio.CancelledError, GeneratorExit))
                                 else "INTERNAL")
            raise
        finally:
            end["duration_s"] = round(time.monotonic() - started, 4)
            log_event(log, f"{what} end", **end)
            tracing.finish(end.span, **end)
