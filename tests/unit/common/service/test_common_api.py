"""Output constraints across the wire (common_api.py): every kind to protobuf and back
unchanged, and a message that sets none is refused naming every kind."""
from __future__ import annotations

import pytest

from common.engine.structured_output.params import KINDS, StructuredOutputsParams
from common.service.common_api import structured_output_from_pb, structured_output_to_pb
from common.service.errors import ServiceError
from protos.pdserve.v1 import common_pb2

TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                            "content": {"type": "regex", "pattern": "[0-9]+"}}}


@pytest.mark.parametrize("constraint", [{"json": {"type": "object"}}, {"json_object": True}, {"regex": "a+"},
                                        {"choice": ["x", "y"]}, {"grammar": 'root ::= "a"'},
                                        {"structural_tag": TAG}, {"regex": "a", "start_after_token_ids": (3, 4)}],
                         ids=lambda c: next(iter(c)))
def test_every_kind_crosses_the_wire_unchanged(constraint):
    params = StructuredOutputsParams(**constraint)
    assert structured_output_from_pb(structured_output_to_pb(params)) == params


def test_a_message_without_a_kind_names_every_kind():
    with pytest.raises(ServiceError, match=f"structured_output must set one of {', '.join(KINDS)}"):
        structured_output_from_pb(common_pb2.StructuredOutput())
    assert "structural_tag" in KINDS
