"""The LoRA adapters an instance serves (vLLM's --lora-modules NAME=PATH ...): the names it
registers, which the gateway routes requests by, and the LoRARequest a request naming one
runs with. Plain Python."""
from __future__ import annotations

import grpc

from common.engine.lora.request import LoRARequest
from common.service.errors import ServiceError


class LoRAModules:
    def __init__(self, paths: dict[str, str] | None = None):
        # Ids in the order given, from 1 (vLLM's lora_int_id: 0 is the base model).
        self._requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate((paths or {}).items(), 1)}

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
