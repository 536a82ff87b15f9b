"""SchedulerOutput and RunnerOutput as plain data (msgpack), for executor worker processes.

Every dataclass field goes through by name, so a field added to outputs.py travels
without a change here unless it holds something other than plain data. The grammar
bitmask travels as {"dtype", "shape", "data": bytes}. `unpack` refuses what is not
msgpack of the expected shape (a pickle, above all: nothing here ever unpickles).
"""
from __future__ import annotations

import dataclasses
import functools
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


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _fields(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in _field_names(type(obj))}


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


@dataclasses.dataclass
class _SentRequest:
    """What the decoders already hold of a request (the objects themselves, so `is` is sound)."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_sent: int


class SchedulerOutputEncoder:
    """SchedulerOutputs as dicts for a stream of steps to the same decoders: a request's
    sampling params and prompt go once, its output tokens as they grow ("cached": true,
    output_token_ids holding only the new ones), as vLLM sends cached request data. A
    request whose objects changed (re-admitted under the same id) goes whole again;
    finished_req_ids end the state on both sides."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def encode(self, output: SchedulerOutput) -> dict:
        for req_id in output.finished_req_ids:
            self._sent.pop(req_id, None)
        return _fields(output) | {
            "scheduled": [self._request(r) for r in output.scheduled],
            "kv_connector_metadata": kv_connector_metadata_to_dict(output.kv_connector_metadata),
            "grammar_bitmask": tensor_to_dict(output.grammar_bitmask),
        }

    def _request(self, req: ScheduledRequest) -> dict:
        plain = _fields(req)
        sent = self._sent.get(req.req_id)
        outputs = req.output_token_ids
        if (sent is not None and sent.sampling_params is req.sampling_params
                and sent.prompt_token_ids is req.prompt_token_ids and sent.output_token_ids is outputs
                and sent.num_output_sent <= len(outputs)):
            plain |= {"cached": True, "sampling_params": None, "prompt_token_ids": None,
                      "output_token_ids": outputs[sent.num_output_sent:]}
            sent.num_output_sent = len(outputs)
            return plain
        self._sent[req.req_id] = _SentRequest(req.sampling_params, req.prompt_token_ids, outputs, len(outputs))
        return plain | {"cached": False, "sampling_params": req.sampling_params.to_dict()}


class SchedulerOutputDecoder:
    """The other end of SchedulerOutputEncoder: keeps each running request's params and
    token history between steps (validating params again every step would cost more
    than the step's transport)."""

    def __init__(self) -> None:
        self._requests: dict[str, tuple[SamplingParams, list[int], list[int]]] = {}

    def decode(self, data: dict) -> SchedulerOutput:
        try:
            for req_id in data["finished_req_ids"]:
                self._requests.pop(req_id, None)
            return SchedulerOutput(**(data | {
                "scheduled": [self._request(r) for r in data["scheduled"]],
                "kv_connector_metadata": kv_connector_metadata_from_dict(data["kv_connector_metadata"]),
                "grammar_bitmask": tensor_from_dict(data["grammar_bitmask"]),
            }))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MessageFormatError(f"not a SchedulerOutput: {type(e).__name__}: {e}") from None

    def _request(self, plain: dict) -> ScheduledRequest:
        plain = dict(plain)
        req_id = plain["req_id"]
        if plain.pop("cached"):
            known = self._requests.get(req_id)
            if known is None:
                raise ValueError(f"request {req_id!r} is sent as cached but was never sent whole")
            params, prompt_token_ids, output_token_ids = known
            output_token_ids.extend(plain["output_token_ids"])
        else:
            params = SamplingParams.from_dict(plain["sampling_params"])
            prompt_token_ids, output_token_ids = plain["prompt_token_ids"], list(plain["output_token_ids"])
            self._requests[req_id] = (params, prompt_token_ids, output_token_ids)
        return ScheduledRequest(**(plain | {"sampling_params": params, "prompt_token_ids": prompt_token_ids,
                                            "output_token_ids": output_token_ids}))


def scheduler_output_to_dict(output: SchedulerOutput) -> dict:
    """One step on its own (every request sent whole)."""
    return SchedulerOutputEncoder().encode(output)


def scheduler_output_from_dict(data: dict) -> SchedulerOutput:
    return SchedulerOutputDecoder().decode(data)


# ---- RunnerOutput ----
def _logprobs_to_list(logprobs: Logprobs) -> list:
    return [logprobs.token_logprob, logprobs.top_token_ids, logprobs.top_logprobs, logprobs.token_rank]


def runner_output_to_dict(output: RunnerOutput) -> dict:
    return _fields(output) | {
        "logprobs": None if output.logprobs is None else [
            None if row is None else [_logprobs_to_list(lp) for lp in row] for row in output.logprobs],
        "kv_transfer_outcomes": [_fields(o) for o in output.kv_transfer_outcomes],
        "prompt_logprobs": None if output.prompt_logprobs is None else {
            req_id: [first_position, [_logprobs_to_list(lp) for lp in row]]
            for req_id, (first_position, row) in output.prompt_logprobs.items()},
    }


def runner_output_from_dict(data: dict) -> RunnerOutput:
    try:
        logprobs, prompt_logprobs = data["logprobs"], data["prompt_logprobs"]
        return RunnerOutput(**(data | {
            "logprobs": None if logprobs is None else [
                None if row is None else [Logprobs(*lp) for lp in row] for row in logprobs],
            "kv_transfer_outcomes": [KVTransferOutcome(**o) for o in data["kv_transfer_outcomes"]],
            "prompt_logprobs": None if prompt_logprobs is None else {
                req_id: (first_position, [Logprobs(*lp) for lp in row])
                for req_id, (first_position, row) in prompt_logprobs.items()},
        }))
    except (KeyError, TypeError, ValueError) as e:
        raise MessageFormatError(f"not a RunnerOutput: {type(e).__name__}: {e}") from None
