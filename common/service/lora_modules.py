"""The LoRA adapters an instance serves (vLLM's --lora-modules NAME=PATH ..., then those
loaded and unloaded at run time through LoRAAdapterService): the names it registers, which
the gateway routes requests by, and the LoRARequest a request naming one runs with. Plain
Python; used from the event loop only."""
from __future__ import annotations

import itertools

import grpc

from common.engine.lora.request import LoRARequest
from common.service.errors import ServiceError


class LoRAModules:
    def __init__(self, paths: dict[str, str] | None = None):
        # Ids from 1 in the order loaded, never reused (vLLM's lora_int_id: 0 is the base model).
        self._ids = itertools.count(1)
        self._requests = {name: LoRARequest(name, next(self._ids), path) for name, path in (paths or {}).items()}
        self._loaded_at_run_time: set[str] = set()  # names `add`ed since the start
        # Bumped by each change, so that a gateway can tell a newer report of the names from an older one.
        self.version = 0

    @classmethod
    def parse(cls, specs: list[str] | None) -> LoRAModules:
        """NAME=PATH specs; ValueError for a malformed or repeated one."""
        paths: dict[str, str] = {}
        for spec in specs or []:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
            if name in paths:
                raise ValueError(f"--lora-modules names {name!r} twice")
            paths[name] = path
        return cls(paths)

    @property
    def names(self) -> list[str]:
        return list(self._requests)

    @property
    def requests(self) -> list[LoRARequest]:
        return list(self._requests.values())

    def __contains__(self, lora_name: str) -> bool:
        return lora_name in self._requests

    def new_request(self, lora_name: str, lora_path: str) -> LoRARequest:
        """A request for an adapter to load under a fresh id (served once `add`ed)."""
        return LoRARequest(lora_name, next(self._ids), lora_path)

    @property
    def runtime_paths(self) -> dict[str, str]:
        """The adapters loaded at run time (not from --lora-modules), name -> path."""
        return {name: self._requests[name].lora_path for name in self._requests if name in self._loaded_at_run_time}

    def add(self, lora: LoRARequest) -> None:
        """Serve `lora` under its name, in place of any adapter of that name (loaded at run time)."""
        self._requests[lora.lora_name] = lora
        self._loaded_at_run_time.add(lora.lora_name)
        self.version += 1

    def remove(self, lora_name: str) -> None:
        del self._requests[lora_name]
        self._loaded_at_run_time.discard(lora_name)
        self.version += 1

    def resolve(self, lora_name: str | None) -> LoRARequest | None:
        """The adapter a request names (None: the base model); INVALID_ARGUMENT for one this
        instance does not serve."""
        if lora_name is None:
            return None
        lora = self._requests.get(lora_name)
        if lora is None:
            served = ", ".join(self._requests) or "none"
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"LoRA adapter {lora_name!r} is not served by this instance (it serves: {served})")
        return lora
