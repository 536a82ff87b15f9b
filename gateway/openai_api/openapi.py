"""The OpenAPI 3.1 document of the HTTP API this gateway serves (GET /openapi.json).

The request bodies are written from protocol.py's field tables (COMPLETION_FIELDS,
CHAT_FIELDS, STREAM_OPTIONS, TOKENIZE_FIELDS, DETOKENIZE_FIELDS), responses_api.py's
(RESPONSES_FIELDS), embeddings.py's
(EMBEDDING_FIELDS) and scores.py's (SCORE_FIELDS, RERANK_FIELDS): each check there carries the JSON Schema of what it
accepts, with the bounds of the README's "Request bounds", so a field added, removed
or re-bounded there is so here too. What only holds between fields (min_tokens <=
max_tokens, n times the number of prompts, the prompt's length in tokens) is said in
descriptions; such a request is a 400 naming the field. Optional fields are nullable:
null means unset.
"""
from __future__ import annotations

from collections.abc import Callable

from gateway.openai_api.embeddings import EMBEDDING_FIELDS, MAX_EMBEDDING_INPUTS
from gateway.openai_api.lora_adapters import LOAD_FIELDS, LOAD_PATH, UNLOAD_FIELDS, UNLOAD_PATH
from gateway.openai_api.lora_adapters import REQUIRED_FIELDS as LORA_REQUIRED_FIELDS
from gateway.openai_api.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    STREAM_OPTIONS,
    TOKENIZE_FIELDS,
)
from gateway.openai_api.responses_api import RESPONSES_FIELDS
from gateway.openai_api.scores import RERANK_FIELDS, SCORE_FIELDS, SCORE_SIDES

OPENAPI_VERSION = "3.1.0"
ERROR_STATUSES = {
    "400": "A bad request: malformed JSON, an unknown field, a wrong type or an out-of-range value "
           "(`param` names the field)",
    "404": "The model is not served here",
    "413": "The body is larger than --max-message-bytes",
    "429": "The gateway's wait queue is full (admission control); retry after Retry-After seconds",
    "503": "No decode instance is alive, or the gateway is draining",
    "504": "The request's deadline passed",
}
# Fields the request cannot do without (null counts as missing).
REQUIRED_FIELDS = {"completion": ["model", "prompt"], "chat": ["model", "messages"], "detokenize": ["tokens"],
                   "rerank": ["query", "documents"], "responses": ["model", "input"]}

ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def nullable(schema: dict) -> dict:
    """`schema` or null (the parser takes null as unset), as simply as JSON Schema can say it."""
    if schema.get("type") == "null":
        return schema
    if isinstance(schema.get("type"), str) and set(schema) <= {"type", "minimum", "maximum", "exclusiveMinimum"}:
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def fields_schema(fields: dict[str, Callable], required: list[str], served_model_names: list[str]) -> dict:
    """A request body's schema from a protocol.py field table (field name -> check)."""
    properties = {}
    for name, check in fields.items():
        schema = dict(check.json_schema)
        if name == "model":  # other names are a 404
            schema = {"type": "string", "enum": served_model_names,
                      "description": "the name GET /v1/models lists"}
        elif name == "stream_options":
            schema = {**schema, "additionalProperties": False, "description": "only with stream: true",
                      "properties": {option: nullable(option_check.json_schema)
                                     for option, option_check in STREAM_OPTIONS.items()}}
        properties[name] = schema if name in required else nullable(schema)
    return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}


def exactly_one_of(schema: dict, names: tuple[str, ...]) -> dict:
    """`schema` with exactly one of the fields `names` set (not null)."""
    alternatives = []
    for name in names:
        others = [other for other in names if other != name]
        alternatives.append({"required": [name], "properties": {name: {"not": {"type": "null"}}},
                             "not": {"anyOf": [{"required": [other], "properties": {other: {"not": {"type": "null"}}}}
                                               for other in others]}})
    return {**schema, "oneOf": alternatives}


def _generate_operation(summary: str, schema_name: str) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
        "responses": {
            "200": {"description": "The completion (JSON), or with stream: true server-sent events",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **{status: {"description": description,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
               for status, description in ERROR_STATUSES.items()}}}


def _json_operation(summary: str, schema_name: str, response: dict,
                    statuses: tuple[str, ...] = ("400", "404", "413")) -> dict:
    """A POST whose body is components' schema_name and whose answer is `response` or one of `statuses`."""
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
        "responses": {
            "200": {"description": "ok", "content": {"application/json": {"schema": response}}},
            **{status: {"description": ERROR_STATUSES[status],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
               for status in statuses}}}


MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"enum": ["model"]}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}
TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}},
    "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]}}}
EMBEDDING_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "data", "usage"],
                      "properties": {
    "id": {"type": "string"}, "object": {"enum": ["list"]}, "created": {"type": "integer"}, "model": {"type": "string"},
    "data": {"type": "array", "maxItems": MAX_EMBEDDING_INPUTS, "items": {
        "type": "object", "required": ["index", "object", "embedding"], "properties": {
            "index": {"type": "integer"}, "object": {"enum": ["embedding"]},
            "embedding": {"anyOf": [{"type": "array", "items": {"type": "number"}},
                                    {"type": "string", "description": "base64 of little-endian float32"}]}}}},
    "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
        "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "total_tokens": {"type": "integer"}}}
SCORE_RESPONSE = {"type": "object", "required": ["id", "object", "created", "model", "data", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"enum": ["list"]}, "created": {"type": "integer"}, "model": {"type": "string"},
    "data": {"type": "array", "items": {"type": "object", "required": ["index", "object", "score"], "properties": {
        "index": {"type": "integer"}, "object": {"enum": ["score"]},
        "score": {"type": "number", "description": "the cosine similarity of the pair's embeddings"}}}},
    "usage": _USAGE}}
RERANK_RESPONSE = {"type": "object", "required": ["id", "model", "usage", "results"], "properties": {
    "id": {"type": "string"}, "model": {"type": "string"}, "usage": _USAGE,
    "results": {"type": "array", "description": "best first", "items": {
        "type": "object", "required": ["index", "document", "relevance_score"], "properties": {
            "index": {"type": "integer"}, "relevance_score": {"type": "number"},
            "document": {"type": "object", "properties": {"text": {"type": "string"}}}}}}}}
DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}


def _status_operation(summary: str, not_ok: str) -> dict:
    body = {"content": {"application/json": {"schema": {
        "type": "object", "required": ["status"], "properties": {"status": {"type": "string"},
                                                                  "reason": {"type": "string"}}}}}}
    return {"summary": summary, "responses": {"200": {"description": "ok", **body},
                                              "503": {"description": not_ok, **body}}}


def _lora_operation(summary: str, schema_name: str, statuses: tuple[str, ...]) -> dict:
    return {"summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
            "responses": {"200": {"description": "Success: vLLM's line", "content": {"text/plain": {
                "schema": {"type": "string"}}}},
                **{status: {"description": description, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/Error"}}}} for status, description in statuses}}}


LORA_LOAD_STATUSES = (("400", "A bad body; a name already loaded (without load_inplace) or the base model's; an "
                              "adapter an instance cannot serve; no instance runs with --enable-lora"),
                      ("429", "Requests in flight still use the adapter being replaced; retry when they finish"),
                      ("503", "An instance did not answer"))
LORA_UNLOAD_STATUSES = (("400", "A bad body"), ("404", "No instance serves the adapter"),
                        ("503", "An instance did not answer"))


def _lora_paths(served_model_names: list[str]) -> tuple[dict, dict]:
    """(paths, schemas) of the run-time LoRA routes."""
    return ({LOAD_PATH: {"post": _lora_operation("Load a LoRA adapter on every instance that runs with LoRA",
                                                 "LoadLoRAAdapterRequest", LORA_LOAD_STATUSES)},
             UNLOAD_PATH: {"post": _lora_operation("Unload a LoRA adapter from every instance that serves it",
                                                   "UnloadLoRAAdapterRequest", LORA_UNLOAD_STATUSES)}},
            {"LoadLoRAAdapterRequest": fields_schema(LOAD_FIELDS, LORA_REQUIRED_FIELDS["load"], served_model_names),
             "UnloadLoRAAdapterRequest": fields_schema(UNLOAD_FIELDS, LORA_REQUIRED_FIELDS["unload"],
                                                       served_model_names)})


def openapi_document(served_model_names: list[str], version: str = "0.1.0",
                     request_chat_templates: bool = False, runtime_lora_updating: bool = False) -> dict:
    """The document for a gateway serving the model under `served_model_names`; a request's
    own `chat_template` is described only where the gateway runs them
    (--trust-request-chat-template): elsewhere it is a 400; the LoRA load and unload routes
    only where they are served (--allow-runtime-lora-updating)."""
    lora_paths, lora_schemas = _lora_paths(served_model_names) if runtime_lora_updating else ({}, {})
    chat_fields, tokenize_fields, embedding_fields = CHAT_FIELDS, TOKENIZE_FIELDS, EMBEDDING_FIELDS
    if not request_chat_templates:
        chat_fields, tokenize_fields, embedding_fields = (
            {name: check for name, check in fields.items() if name != "chat_template"}
            for fields in (CHAT_FIELDS, TOKENIZE_FIELDS, EMBEDDING_FIELDS))
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "pdserve OpenAI-compatible API", "version": version},
        "paths": {
            "/v1/completions": {"post": _generate_operation("Text completion", "CompletionRequest")},
            "/v1/chat/completions": {"post": _generate_operation("Chat completion", "ChatCompletionRequest")},
            "/v1/responses": {"post": _generate_operation(
                "Response (OpenAI's Responses API), run as the chat completion it means; stored unless store is "
                "false", "ResponsesRequest")},
            "/v1/responses/{response_id}": {
                method: {"summary": summary, "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                    "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {
                        "type": "object"}}}}, "404": {"description": "No stored response has this id", "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}
                for method, summary in (("get", "A stored response, as it was answered"),
                                        ("delete", "Forget a stored response"))},
            "/v1/responses/{response_id}/cancel": {"post": {
                "summary": "Cancel a background response (stored as cancelled); a finished one is answered as it is",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {
                    "type": "object"}}}}, "400": {"description": "Not a background response", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                    "404": {"description": "No stored response has this id", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}},
            "/v1/responses/{response_id}/input_items": {"get": {
                "summary": "A stored response's input items (newest first unless order=asc)",
                "parameters": [
                    {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},
                    {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                    {"name": "after", "in": "query", "schema": {"type": "string"}}],
                "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {
                    "type": "object"}}}}, "400": {"description": ERROR_STATUSES["400"], "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
                    "404": {"description": "No stored response has this id", "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}},
            "/v1/embeddings": {"post": _json_operation(
                "Embeddings: each input's final hidden state at its last token, pooled (exactly one of input and "
                "messages)", "EmbeddingRequest", EMBEDDING_RESPONSE, tuple(ERROR_STATUSES))},
            **{path: {"post": _json_operation(
                "Scores: the cosine similarity of each query's and document's embeddings (one pair of sides: "
                "1:1, 1:N or N:N)", "ScoreRequest", SCORE_RESPONSE, tuple(ERROR_STATUSES))}
               for path in ("/score", "/v1/score")},
            **{path: {"post": _json_operation(
                "Rerank: the documents by the cosine similarity of their embeddings to the query's, best first",
                "RerankRequest", RERANK_RESPONSE, tuple(ERROR_STATUSES))}
               for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
            "/v1/models": {"get": {"summary": "The served model", "responses": {"200": {
                "description": "One model", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"], "properties": {
                        "object": {"enum": ["list"]}, "data": {"type": "array", "items": MODEL_CARD}}}}}}}}},
            "/v1/models/{model}": {"get": {
                "summary": "The served model by name",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string", "enum": served_model_names}}],
                "responses": {"200": {"description": "The model", "content": {"application/json": {
                    "schema": MODEL_CARD}}},
                    "404": {"description": ERROR_STATUSES["404"], "content": {"application/json": {
                        "schema": {"$ref": "#/components/schemas/Error"}}}}}}},
            "/version": {"get": {"summary": "pdserve's version", "responses": {"200": {
                "description": "ok", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}}}}}}},
            "/tokenize": {"post": _json_operation("A prompt or chat messages as the token ids generation gets "
                                                  "(exactly one of prompt and messages)", "TokenizeRequest",
                                                  TOKENIZE_RESPONSE)},
            "/detokenize": {"post": _json_operation("Token ids as text", "DetokenizeRequest", DETOKENIZE_RESPONSE)},
            "/health": {"get": _status_operation("Liveness", "The gateway is draining to stop")},
            "/ready": {"get": _status_operation("Readiness", "No decode instance is alive, or draining")},
            "/invocations": {"post": {**_generate_operation(
                "SageMaker's inference route: a chat completion, completion or embeddings request, told apart by "
                "its messages, prompt or input", "ChatCompletionRequest"),
                "requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
                    {"$ref": f"#/components/schemas/{name}"}
                    for name in ("ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest")]}}}}}},
            "/ping": {method: _status_operation("Liveness (SageMaker's name for /health)",
                                                "The gateway is draining to stop") for method in ("get", "post")},
            "/metrics": {"get": {"summary": "The gateway's Prometheus metrics (text exposition format)",
                                 "responses": {"200": {"description": "ok", "content": {
                                     "text/plain": {"schema": {"type": "string"}}}}}}},
            "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
                "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            **lora_paths,
        },
        "components": {"schemas": {
            "CompletionRequest": fields_schema(COMPLETION_FIELDS, REQUIRED_FIELDS["completion"], served_model_names),
            "ChatCompletionRequest": fields_schema(chat_fields, REQUIRED_FIELDS["chat"], served_model_names),
            "ResponsesRequest": fields_schema(RESPONSES_FIELDS, REQUIRED_FIELDS["responses"], served_model_names),
            "TokenizeRequest": fields_schema(tokenize_fields, [], served_model_names),
            "EmbeddingRequest": exactly_one_of(fields_schema(embedding_fields, [], served_model_names),
                                               ("input", "messages")),
            "ScoreRequest": {**fields_schema(SCORE_FIELDS, [], served_model_names),
                             "anyOf": [{"required": list(side)} for side in SCORE_SIDES],
                             "description": "exactly one pair of sides: " + ", ".join(
                                 f"{first} and {second}" for first, second in SCORE_SIDES)},
            "RerankRequest": fields_schema(RERANK_FIELDS, REQUIRED_FIELDS["rerank"], served_model_names),
            "DetokenizeRequest": fields_schema(DETOKENIZE_FIELDS, REQUIRED_FIELDS["detokenize"], served_model_names),
            **lora_schemas,
            "Error": ERROR_BODY,
        }},
    }
