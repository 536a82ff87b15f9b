"""Engine and model configs as plain data and back, to hand them to a worker process as
msgpack: nested dataclasses become dicts, tuples lists; the field types bring them back."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


def config_to_plain(config: Any) -> dict:
    return dataclasses.asdict(config)


def config_from_plain(cls: type, data: dict) -> Any:
    """cls(**data) with each nested dataclass and tuple rebuilt from its field's type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {sorted(unknown)}")
    return cls(**{name: _from_plain(hints[name], value) for name, value in data.items()})


def _from_plain(tp: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg) and isinstance(value, dict):
                return config_from_plain(arg, value)
            if typing.get_origin(arg) is tuple and isinstance(value, list):
                return tuple(value)
        return value
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return config_from_plain(tp, value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return value
