"""bench.bounds measures what it says: every neighbour it sends is served by the gateway's
own validation, with its lists exactly at the documented bounds (one more would be refused)."""
from __future__ import annotations

import pytest

from bench.bounds import NEIGHBOURS, _request
from common.engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from gateway.api import generate_input_from_pb
from gateway.validation import MAX_CHAT_MESSAGES, load_served_model, prepare_request

MAX_MODEL_LEN = 8192  # the bundled model's


@pytest.fixture(scope="module")
def model():
    return load_served_model(None)


@pytest.mark.parametrize("kind", [k for k in NEIGHBOURS if k != "none"])
def test_every_neighbour_is_served_with_its_lists_at_the_bounds(model, kind):
    request = _request(kind, 64, f"req-{kind}")
    prepared = prepare_request(generate_input_from_pb(request), model, MAX_MODEL_LEN, 262_144)
    bounded = {"stop strings": kind in ("stop strings", "all bounds"),
               "stop token ids": kind in ("stop token ids", "all bounds"),
               "chat messages": kind in ("chat messages", "all bounds")}
    assert len(prepared.sampling.stop) == (MAX_STOP_STRINGS if bounded["stop strings"] else 0)
    assert len(prepared.sampling.stop_token_ids) == (MAX_STOP_TOKEN_IDS if bounded["stop token ids"] else 0)
    assert len(request.messages.messages) == (MAX_CHAT_MESSAGES if bounded["chat messages"] else 0)
    assert prepared.sampling.max_tokens == 64
