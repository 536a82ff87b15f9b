"""Errors the engine raises to its frontends when it can no longer run. Torch-free, so
the service kit maps them to gRPC statuses without loading the engine."""
from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop stopped: no request will make progress on this engine again."""


class RequestIdReleasingError(ValueError):
    """The id's earlier request was cancelled and the engine still holds it (its abort,
    or a KV transfer it waits on, has not finished): a new one with the id must wait, or
    the earlier request's last outputs would reach the new stream."""


class LoRAAdaptersBusyError(ValueError):
    """Every LoRA adapter slot (max_loras) holds an adapter a live request uses: one naming
    another adapter must wait until one finishes (a transient refusal, not a bad request)."""


class ExecutorFailedError(EngineDeadError):
    """A worker process of the executor died or broke the protocol; names the rank."""
