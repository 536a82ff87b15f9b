"""What the property-based tests of trust-boundary parsers share: bounded, reproducible
hypothesis settings, and strategies for hostile input (any JSON or msgpack value, any protobuf
message of a given type with every field at hostile values).

    @BOUNDED
    @given(pb_messages(generate_pb2.GenerateRequest))
    def test_...(msg): ...
"""
from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Fast enough for the unit suite; derandomized (draws seeded from the test, not from the
# clock) and without an example database, so a failure is not a matter of luck.
BOUNDED = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])



def _nested(scalars: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(scalars, lambda children: st.lists(children, max_size=4)
                        | st.dictionaries(st.text(max_size=10), children, max_size=4), max_leaves=12)


_SCALARS = st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
json_values = _nested(_SCALARS | st.integers(min_value=-(2**70), max_value=2**70))
msgpack_values = _nested(_SCALARS | st.binary(max_size=8) | st.integers(min_value=-(2**63), max_value=2**64 - 1))

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _hostile_ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Edges (0, -1, the type's limits) as often as ordinary values."""
    edges = [v for v in (0, 1, -1, 2, lo, hi, lo + 1, hi - 1, 2**31 - 1, 2**31) if lo <= v <= hi]
    return st.sampled_from(edges) | st.integers(min_value=max(lo, -1000), max_value=min(hi, 100_000)) \
        | st.integers(min_value=lo, max_value=hi)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy:
    if field.type in _INT_RANGES:
        return _hostile_ints(*_INT_RANGES[field.type])
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1.0, math.inf])
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32, allow_nan=True, allow_infinity=True)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=12) | st.sampled_from(["", "decode", "prefill", "user", "x" * 300])
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if field.type == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.sampled_from(known) | st.integers(min_value=-5, max_value=1000)  # unknown values too
    raise TypeError(f"no strategy for field {field.full_name} of type {field.type}")


def pb_messages(message_class, depth: int = 3) -> st.SearchStrategy:
    """Messages of `message_class` with any subset of fields set, at hostile values
    (edge integers, NaN and infinities, unknown enum values, empty and odd strings);
    submessages to `depth`."""
    descriptor = message_class.DESCRIPTOR
    field_strategies = {}
    for field in descriptor.fields:
        if _is_map(field):
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            field_strategies[field.name] = st.dictionaries(_scalar(key), _scalar(value), max_size=6)
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth == 0:
                continue
            value = pb_messages(field.message_type._concrete_class, depth - 1)
        else:
            value = _scalar(field)
        field_strategies[field.name] = st.lists(value, max_size=6) if _is_repeated(field) else value

    @st.composite
    def build(draw):
        msg = message_class()
        names = draw(st.sets(st.sampled_from(sorted(field_strategies)))) if field_strategies else set()
        for name in sorted(names):
            value = draw(field_strategies[name])
            field = descriptor.fields_by_name[name]
            if _is_map(field):
                getattr(msg, name).update(value)
            elif _is_repeated(field):
                getattr(msg, name).extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return build()


def _is_map(field: FieldDescriptor) -> bool:
    """A map<K, V> field: repeated entries of a generated message, filled as a dict (scalar
    values only: no map of messages travels in these protos)."""
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    return repeated if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED
