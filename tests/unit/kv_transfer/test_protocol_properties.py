"""Property tests of the KV-transfer header decoder (kv_transfer.protocol.decode), which
reads whatever arrives on a decode instance's KV socket: any bytes, and any msgpack map
shaped like a header with hostile values, decode or raise ProtocolError, never anything
else; every header the encoders write decodes to what was encoded."""
from __future__ import annotations

import msgpack
from hypothesis import given
from hypothesis import strategies as st

from kv_transfer import protocol
from tests.support.properties import BOUNDED, msgpack_values

HOSTILE = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True) | st.text(max_size=8) | st.binary(max_size=8)
           | st.lists(st.integers(-2, 2**32), max_size=5) | msgpack_values)
KEYS = sorted(set().union(*protocol._KEYS.values()))
VALID = {"v": protocol.VERSION, "op": "kv", "tid": "t", "seq": 0, "layer": 0, "nlay": 1, "first": 0, "nblk": 2,
         "h0": 0, "nh": 2, "dtype": "float16", "shape": [16, 2, 64], "splits": [2], "reason": "", "state": "done"}


def decodes_or_protocol_error(frame: bytes) -> None:
    try:
        protocol.decode(frame)
    except protocol.ProtocolError:
        pass


@BOUNDED
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_protocol_error(frame):
    decodes_or_protocol_error(frame)


@BOUNDED
@given(st.sampled_from(protocol.OPS), st.dictionaries(st.sampled_from(KEYS), HOSTILE, max_size=5),
       st.sets(st.sampled_from(KEYS), max_size=2))
def test_header_shaped_maps_with_hostile_values_decode_or_raise_protocol_error(op, changes, dropped):
    header = {k: VALID[k] for k in protocol._KEYS[op] if k not in dropped} | {"op": op} | changes
    decodes_or_protocol_error(msgpack.packb(header))


@BOUNDED
@given(st.text(min_size=1, max_size=protocol.MAX_TRANSFER_ID_LEN), st.integers(0, 2**31 - 1),
       st.integers(0, 2**31 - 1), st.integers(1, 2**31 - 1), st.lists(st.integers(1, 1024), min_size=1, max_size=8),
       st.lists(st.integers(1, 64), min_size=1, max_size=16), st.integers(1, 64), st.integers(0, 2**31 - 1))
def test_encoded_kv_headers_decode_to_what_was_encoded(tid, seq, layer, num_blocks, shape, splits, num_layers,
                                                       head_start):
    h = protocol.decode(protocol.encode_kv(tid, seq, layer, 0, num_blocks, "bfloat16", shape, splits, num_layers,
                                           head_start))
    assert (h.transfer_id, h.seq, h.layer, h.num_blocks, h.block_shape, h.splits, h.num_layers, h.head_start) == (
        tid, seq, layer, num_blocks, tuple(shape), tuple(splits), num_layers, head_start)
