"""read_gguf against gguf's own writer (GGUFWriter): every file it writes reads back with the
same scalar and string metadata and the same tensors, and a file cut anywhere either reads
back the same (a cut in the trailing padding) or fails with a ValueError that says so."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.models.quantization.gguf_blocks import read_gguf

VT = gguf.GGUFValueType
_INT_RANGES = {VT.UINT8: (0, 2**8 - 1), VT.INT8: (-2**7, 2**7 - 1), VT.UINT16: (0, 2**16 - 1),
               VT.INT16: (-2**15, 2**15 - 1), VT.UINT32: (0, 2**32 - 1), VT.INT32: (-2**31, 2**31 - 1),
               VT.UINT64: (0, 2**64 - 1), VT.INT64: (-2**63, 2**63 - 1)}


def _scalar(value_type):
    if value_type in _INT_RANGES:
        return st.integers(*_INT_RANGES[value_type])
    if value_type == VT.FLOAT32:
        return st.floats(width=32, allow_nan=False)
    if value_type == VT.FLOAT64:
        return st.floats(allow_nan=False)
    if value_type == VT.BOOL:
        return st.booleans()
    return st.text(max_size=12)  # STRING


_SCALAR_TYPES = [*_INT_RANGES, VT.FLOAT32, VT.FLOAT64, VT.BOOL, VT.STRING]
# (value type, value, array item type or None): read_gguf steps over arrays (GGUFWriter writes no empty one).
_FIELDS = st.one_of(
    st.sampled_from(_SCALAR_TYPES).flatmap(lambda t: _scalar(t).map(lambda v: (t, v, None))),
    st.sampled_from(_SCALAR_TYPES).flatmap(
        lambda t: st.lists(_scalar(t), min_size=1, max_size=5).map(lambda vs: (VT.ARRAY, vs, t))))
_KEYS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=16)
_TENSORS = st.lists(st.tuples(st.sampled_from([np.float32, np.float16]),
                              st.lists(st.integers(1, 5), min_size=1, max_size=3)), max_size=3)


def _write(path, fields: dict, tensor_specs) -> dict[str, np.ndarray]:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value_type, value, item_type) in fields.items():
        writer.add_key_value(key, value, value_type, sub_type=item_type)
    rng = np.random.default_rng(0)
    tensors = {}
    for i, (dtype, shape) in enumerate(tensor_specs):
        tensors[f"t{i}"] = rng.standard_normal(shape).astype(dtype)
        writer.add_tensor(f"t{i}", tensors[f"t{i}"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def _expected_metadata(fields: dict) -> dict:
    expected = {"general.architecture": "llama"}
    for key, (value_type, value, _) in fields.items():
        if value_type == VT.FLOAT32:
            expected[key] = float(np.float32(value))
        elif value_type != VT.ARRAY:
            expected[key] = value
    return expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(_KEYS.filter(lambda k: k != "general.architecture"), _FIELDS, max_size=6),
       tensor_specs=_TENSORS, cut=st.floats(0, 1))
def test_reads_what_gguf_wrote_and_a_cut_file_fails_clearly(tmp_path, fields, tensor_specs, cut):
    path = tmp_path / "model.gguf"
    tensors = _write(path, fields, tensor_specs)
    metadata, read = read_gguf(path)
    assert metadata == _expected_metadata(fields)
    assert sorted(read) == sorted(tensors)
    for name, want in tensors.items():
        assert read[name].data.dtype == want.dtype and np.array_equal(read[name].data, want)

    whole = path.read_bytes()
    path.write_bytes(whole[:int(cut * (len(whole) - 1))])
    try:
        cut_metadata, cut_read = read_gguf(path)
    except ValueError as e:
        assert str(path) in str(e)
        return
    assert cut_metadata == metadata and sorted(cut_read) == sorted(read)
    for name in read:
        assert np.array_equal(cut_read[name].data, read[name].data)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_arrays_nested_past_any_writer_are_refused(tmp_path):
    path = tmp_path / "model.gguf"
    key = b"nested"
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key + struct.pack("<I", 9)
    path.write_bytes(header + struct.pack("<IQ", 9, 1) * 40 + struct.pack("<IQ", 4, 0))
    with pytest.raises(ValueError, match="nested deeper"):
        read_gguf(path)
