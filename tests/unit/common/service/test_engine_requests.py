"""What an instance refuses before a request reaches its engine (validate_request)."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from common.engine.sampling_params import SamplingParams
from common.service.engine_requests import validate_request
from common.service.errors import ServiceError

# validate_request reads only the vocabulary size and the length limit of a core.
CORE = SimpleNamespace(model_config=SimpleNamespace(vocab_size=100), max_model_len=64)


@pytest.mark.parametrize("prompt, params, message", [
    ([1, 100], SamplingParams(), "out of range"),
    ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias: token id 100"),
    ([1], SamplingParams(allowed_token_ids=[3, 100]), "allowed_token_ids: token id 100"),
    ([1], SamplingParams(n=2), "n must be 1"),
    ([1] * 65, SamplingParams(), "longer than the maximum model length"),
])
def test_what_an_instance_cannot_serve_is_invalid_argument(prompt, params, message):
    with pytest.raises(ServiceError) as refused:
        validate_request(prompt, params, CORE)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.message


def test_what_it_can_serve_passes():
    validate_request([1, 99], SamplingParams(logit_bias={99: -100.0}, allowed_token_ids=[0, 99]), CORE)


def test_an_admission_refusal_is_invalid_argument_unless_the_adapter_slots_are_busy():
    import grpc

    from common.engine.errors import LoRAAdaptersBusyError
    from common.service.engine_requests import refused
    assert refused(ValueError("bad prompt")).code == grpc.StatusCode.INVALID_ARGUMENT
    busy = refused(LoRAAdaptersBusyError("all 2 LoRA adapters held are in use"))
    assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in use" in busy.message
