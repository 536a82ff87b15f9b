"""SchedulerOutput and RunnerOutput as plain data (msgpack), for executor worker processes.

Every dataclass field goes through by name, so a field added to outputs.py travels
without a change here unless it holds something other than plain data. The grammar
bitmask travels as {"dtype", "shape", "data": bytes}. `unpack` refuses what is not
msgpack of the expected shape (a pickle, above all: nothing here ever unpickles).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from common.engine.kv_connector.metadata import KVConnectorMetadata, KVRecvSpec, KVSendSpec, KVTransferOutcome
from common.engine.outputs import Logprobs, RunnerOutput, ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams

PICKLE_PROTOCOL_MARK = 0x80  # every pickle of protocol >= 2 starts with it


class MessageFormatError(ValueError):
    """A payload that is not msgpack of the shape the receiver expects."""


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes, what: str) -> dict:
    """The msgpack map `data` holds; MessageFormatError naming `what` otherwise."""
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:
        hint = " (it looks like a pickle, which is never accepted)" if data[:1] == bytes([PICKLE_PROTOCOL_MARK]) \
            else ""
        raise MessageFormatError(f"{what}: payload of {len(data)} bytes is not msgpack{hint}: "
                                 f"{type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise MessageFormatError(f"{what}: expected a msgpack map, got {type(message).__name__}")
    return message


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


# ---- grammar bitmask ----
def tensor_to_dict(tensor: Any) -> dict | None:
    """A torch tensor or numpy array as {"dtype", "shape", "data"}."""
    if tensor is None:
        return None
    array = tensor.detach().cpu().contiguous().numpy() if hasattr(tensor, "detach") else tensor
    return {"dtype": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def tensor_from_dict(data: dict | None):
    """The torch tensor tensor_to_dict described (its own copy of the bytes)."""
    if data is None:
        return None
    import numpy as np
    import torch
    array = np.frombuffer(data["data"], dtype=np.dtype(data["dtype"])).reshape(data["shape"])
    return torch.from_numpy(array.copy())


# ---- SchedulerOutput ----
def scheduled_request_to_dict(req: ScheduledRequest) -> dict:
    return _fields(req) | {"sampling_params": req.sampling_params.to_dict()}


def kv_connector_metadata_to_dict(meta: KVConnectorMetadata | None) -> dict | None:
    if meta is None:
        return None
    return {"sends": [_fields(s) for s in meta.sends], "recvs": [_fields(r) for r in meta.recvs],
            "abort_req_ids": list(meta.abort_req_ids), "abort_reason": dict(meta.abort_reason)}


def kv_connector_metadata_from_dict(data: dict | None) -> KVConnectorMetadata | None:
    if data is None:
        return None
    return KVConnectorMetadata(sends=[KVSendSpec(**s) for s in data["sends"]],
                               recvs=[KVRecvSpec(**r) for r in data["recvs"]],
                               abort_req_ids=data["abort_req_ids"], abort_reason=data["abort_reason"])


def scheduler_output_to_dict(output: SchedulerOutput) -> dict:
    return _fields(output) | {
        "scheduled": [scheduled_request_to_dict(r) for r in output.scheduled],
        "kv_connector_metadata": kv_connector_metadata_to_dict(output.kv_connector_metadata),
        "grammar_bitmask": tensor_to_dict(output.grammar_bitmask),
    }


class SchedulerOutputDecoder:
    """Builds SchedulerOutputs from dicts, keeping each running request's SamplingParams
    between steps: validating them again every step would cost more than the step's
    transport. A request's params are rebuilt whenever their plain form changes."""

    def __init__(self) -> None:
        self._params: dict[str, tuple[dict, SamplingParams]] = {}

    def decode(self, data: dict) -> SchedulerOutput:
        try:
            for req_id in data["finished_req_ids"]:
                self._params.pop(req_id, None)
            scheduled = [ScheduledRequest(**(r | {"sampling_params": self._sampling_params(r)}))
                         for r in data["scheduled"]]
            return SchedulerOutput(**(data | {
                "scheduled": scheduled,
                "kv_connector_metadata": kv_connector_metadata_from_dict(data["kv_connector_metadata"]),
                "grammar_bitmask": tensor_from_dict(data["grammar_bitmask"]),
            }))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MessageFormatError(f"not a SchedulerOutput: {type(e).__name__}: {e}") from None

    def _sampling_params(self, req: dict) -> SamplingParams:
        plain = req["sampling_params"]
        cached = self._params.get(req["req_id"])
        if cached is not None and cached[0] == plain:
            return cached[1]
        params = SamplingParams.from_dict(plain)
        self._params[req["req_id"]] = (plain, params)
        return params


def scheduler_output_from_dict(data: dict) -> SchedulerOutput:
    return SchedulerOutputDecoder().decode(data)


# ---- RunnerOutput ----
def _logprobs_to_list(logprobs: Logprobs) -> list:
    return [logprobs.token_logprob, logprobs.top_token_ids, logprobs.top_logprobs]


def runner_output_to_dict(output: RunnerOutput) -> dict:
    return _fields(output) | {
        "logprobs": None if output.logprobs is None else [
            None if row is None else [_logprobs_to_list(lp) for lp in row] for row in output.logprobs],
        "kv_transfer_outcomes": [_fields(o) for o in output.kv_transfer_outcomes],
    }


def runner_output_from_dict(data: dict) -> RunnerOutput:
    try:
        logprobs = data["logprobs"]
        return RunnerOutput(**(data | {
            "logprobs": None if logprobs is None else [
                None if row is None else [Logprobs(*lp) for lp in row] for row in logprobs],
            "kv_transfer_outcomes": [KVTransferOutcome(**o) for o in data["kv_transfer_outcomes"]],
        }))
    except (KeyError, TypeError, ValueError) as e:
        raise MessageFormatError(f"not a RunnerOutput: {type(e).__name__}: {e}") from None
