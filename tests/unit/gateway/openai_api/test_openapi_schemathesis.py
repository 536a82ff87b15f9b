"""schemathesis against the gateway's own OpenAPI document (GET /openapi.json), on a real
in-process gateway (real gRPC, real uvicorn on 127.0.0.1) with the synthetic decode
instance: per operation, a bounded number of derandomized examples, valid ones and
invalid ones, and no response may be a 5xx (schemathesis' not_a_server_error)."""
from __future__ import annotations

from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from gateway.openai_api.openapi import openapi_document  # noqa: E402
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS, http_gateway, post  # noqa: E402

EXAMPLES_PER_OPERATION = 40
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{model}",
              "GET /version", "GET /health", "GET /ready", "POST /tokenize", "POST /detokenize",
              "POST /v1/embeddings", "POST /score", "POST /v1/score", "POST /rerank", "POST /v1/rerank",
              "POST /v2/rerank", "POST /v1/responses", "GET /metrics", "POST /invocations", "GET /ping",
              "POST /ping"]
# Routes of stored responses: made-up ids find none (the Responses API's tests store and read them).
STORED_RESPONSE_OPERATIONS = ["GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
                              "GET /v1/responses/{response_id}/input_items", "POST /v1/responses/{response_id}/cancel"]


@pytest.fixture(scope="module")
def gw():
    with http_gateway(token_ids=TOKENS) as gateway:
        yield gateway


def served_operations(gw) -> dict[str, object]:
    schema = schemathesis.openapi.from_url(f"http://{gw.http_address}/openapi.json", timeout=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    return {f"{operation.method.upper()} {operation.path}": operation for operation in operations}


def test_the_served_document_is_openapi_py_s_for_the_served_model(gw):
    status, document = post(gw.http_address, "/openapi.json", b"", method="GET")
    assert status == 200 and document == openapi_document([MODEL]) and document["openapi"].startswith("3.1")


def test_the_document_lists_every_route_the_gateway_serves(gw):
    # schemathesis leaves out the route of the document itself.
    assert sorted(served_operations(gw)) == sorted(OPERATIONS + STORED_RESPONSE_OPERATIONS)


# One test per operation through pytest's own parametrization (schemathesis' pytest
# integration fails on this pytest version); hypothesis drives the examples.
def responses(gw, operation_name: str) -> Counter[int]:
    """The statuses of the operation's examples; none may be a 5xx."""
    operation = served_operations(gw)[operation_name]
    base_url = f"http://{gw.http_address}"
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))
    statuses: Counter[int] = Counter()

    @given(case=cases)
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def no_server_error(case):
        response = case.call(base_url=base_url, timeout=30)
        statuses[response.status_code] += 1
        case.validate_response(response, checks=[not_a_server_error])

    no_server_error()
    return statuses


@pytest.mark.parametrize("operation_name", OPERATIONS + STORED_RESPONSE_OPERATIONS)
def test_no_request_the_document_describes_is_a_server_error(gw, operation_name):
    statuses = responses(gw, operation_name)
    if operation_name in STORED_RESPONSE_OPERATIONS:
        assert set(statuses) <= {400, 404} and 404 in statuses, statuses
    else:
        assert 200 in statuses, statuses  # the examples reach the generation path, not only the parser


@pytest.fixture(scope="module")
def lora_gw():
    with http_gateway(token_ids=TOKENS, allow_runtime_lora_updating=True) as gateway:
        yield gateway


@pytest.mark.parametrize("operation_name", ["POST /v1/load_lora_adapter", "POST /v1/unload_lora_adapter"])
def test_no_lora_change_the_document_describes_is_a_server_error(lora_gw, operation_name):
    # No instance runs with LoRA here: a valid load is refused (400), an unload finds nothing (404).
    assert set(responses(lora_gw, operation_name)) <= {400, 404}
