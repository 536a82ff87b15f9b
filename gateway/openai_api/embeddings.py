"""POST /v1/embeddings: OpenAI's request body -> one EmbedInput per input, and the
results back as OpenAI's list of embeddings.

The fields are OpenAI's (input, model, encoding_format, dimensions, user) and vLLM's
extensions (messages for a chat conversation, use_activation, truncate_prompt_tokens,
add_special_tokens, priority, request_id, cache_salt, chat template options), checked as
protocol.py checks the generation bodies (strict: an unknown field is a 400 naming it).
Each input is its own Embed call (Gateway.embed): they run at once, and the first that
fails ends the others.
"""
from __future__ import annotations

import base64
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.engine.pooling_params import MAX_EMBEDDING_DIMENSIONS, PoolingParams
from common.text.chat_template import DEFAULT_CHAT_TEMPLATE_OPTIONS, ChatTemplateOptions
from gateway.core import Gateway
from gateway.openai_api.choices import all_or_none
from gateway.openai_api.errors import invalid_field
from gateway.openai_api.protocol import (
    INT32,
    cache_salt,
    set_prompt,
    checked_fields,
    chat_options_of,
    checked_messages,
    checked_prompts,
    boolean,
    chat_template_text,
    described,
    integer,
    messages_value,
    neutral,
    parse_body,
    string,
    template_kwargs,
)
from gateway.types import EmbeddingResult, EmbedInput

# OpenAI's own cap on the inputs of one request.
MAX_EMBEDDING_INPUTS = 2048
ENCODING_FORMATS = ("float", "base64")


@described({"anyOf": [
    {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
    {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS, "items": {"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1,
                                             "items": {"type": "integer", "minimum": 0}}]}}],
    "description": f"text or token ids, or a list of them (at most {MAX_EMBEDDING_INPUTS}); each at most "
                   f"max_model_len tokens"})
def embedding_input(param: str, value: Any) -> list[str | list[int]]:
    inputs = checked_prompts(value, param)
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise invalid_field(param, f"must hold at most {MAX_EMBEDDING_INPUTS} inputs, got {len(inputs)}")
    return inputs


@described({"enum": list(ENCODING_FORMATS)})
def encoding_format(param: str, value: Any) -> str:
    if value not in ENCODING_FORMATS:
        raise invalid_field(param, f"must be one of {', '.join(ENCODING_FORMATS)}, got {value!r}",
                            code="unsupported_value")
    return value


@described({"type": "null", "description": "removed in vLLM; use use_activation"})
def removed_normalize(param: str, value: Any) -> None:
    raise invalid_field(param, "was removed; use use_activation instead (vLLM's name)", code="unknown_field")


EMBEDDING_FIELDS: dict[str, Callable] = {
    "model": string, "input": embedding_input, "messages": messages_value, "encoding_format": encoding_format,
    "dimensions": integer(1, MAX_EMBEDDING_DIMENSIONS), "user": string, "use_activation": boolean,
    "normalize": removed_normalize,
    "truncate_prompt_tokens": integer(-1, INT32[1], allowed=f"-1 (the model's maximum length) or an integer in "
                                                            f"[1, {INT32[1]}]"),
    "add_special_tokens": boolean, "priority": integer(*INT32), "request_id": string,
    "add_generation_prompt": boolean, "continue_final_message": boolean, "chat_template_kwargs": template_kwargs,
    "chat_template": chat_template_text, "embed_dtype": neutral("float32"), "endianness": neutral("native", "little"),
    "cache_salt": cache_salt,
}
_CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")


@dataclass
class ParsedEmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]] | None = None  # input; None: messages
    messages: list[dict] | None = None
    pooling: PoolingParams = field(default_factory=PoolingParams)
    encoding_format: str = "float"
    request_id: str | None = None
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None
    chat_options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS  # with messages: how they become the prompt
    cache_salt: str | None = None
    trace_headers: dict[str, str] = field(default_factory=dict)  # the HTTP request's W3C trace context

    def embed_inputs(self, response_id: str) -> list[EmbedInput]:
        """One EmbedInput per input, in order; ids the request's (or response_id), -index where several."""
        base_id = self.request_id or response_id
        prompts = self.inputs if self.inputs is not None else [None]
        inputs = []
        for index, prompt in enumerate(prompts):
            request_id = base_id if len(prompts) == 1 else f"{base_id}-{index}"
            request = EmbedInput(pooling=self.pooling, request_id=request_id, priority=self.priority,
                                 model=self.model or "",
                                 add_special_tokens=self.add_special_tokens,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens, cache_salt=self.cache_salt,
                                 trace_headers=self.trace_headers)
            set_prompt(request, prompt, self.messages, self.chat_options)
            inputs.append(request)
        return inputs


def parse_embedding_request(body: bytes) -> ParsedEmbeddingRequest:
    values = checked_fields(parse_body(body), EMBEDDING_FIELDS)
    forms = [name for name in ("input", "messages") if name in values]
    if len(forms) != 1:
        raise invalid_field("input", "set exactly one of input and messages",
                            code="missing_field" if not forms else "invalid_value")
    try:
        pooling = PoolingParams(normalize=values.get("use_activation"), dimensions=values.get("dimensions"))
    except ValueError as e:
        raise invalid_field("dimensions", str(e)) from None
    parsed = ParsedEmbeddingRequest(
        model=values.get("model"), pooling=pooling, encoding_format=values.get("encoding_format", "float"),
        request_id=values.get("request_id"), priority=values.get("priority", 0),
        truncate_prompt_tokens=values.get("truncate_prompt_tokens"),
        add_special_tokens=values.get("add_special_tokens"), cache_salt=values.get("cache_salt"))
    if "messages" in values:
        parsed.messages = checked_messages(values["messages"])
        # An embedding reads the conversation as it stands: no generation prompt unless asked (vLLM's).
        parsed.chat_options = chat_options_of({"add_generation_prompt": False, **values})
    else:
        unused = next((name for name in _CHAT_ONLY_FIELDS if name in values), None)
        if unused is not None:
            raise invalid_field(unused, "only applies to messages")
        parsed.inputs = values["input"]
    return parsed


async def embed_all(gateway: Gateway, inputs: list[EmbedInput]) -> list[EmbeddingResult]:
    """Every input's embedding, computed at once; the first failure cancels the rest and is raised."""
    return await all_or_none([gateway.embed(request) for request in inputs])


def embedding_response(parsed: ParsedEmbeddingRequest, results: list[EmbeddingResult], response_id: str,
                       model_name: str) -> dict:
    """OpenAI's embeddings list: base64 is the float32 values' little-endian bytes (what
    OpenAI's clients decode)."""
    data = []
    for index, result in enumerate(results):
        vector: list[float] | str = result.embedding
        if parsed.encoding_format == "base64":
            vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"index": index, "object": "embedding", "embedding": vector})
    num_prompt_tokens = sum(r.usage.prompt_tokens for r in results)
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model_name, "data": data,
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens,
                      "prompt_tokens_details": {"cached_tokens": sum(r.usage.cached_prompt_tokens for r in results)}}}
