"""The Generate API's one owner: pdserve.v1.GenerateService's messages <-> gateway.types,
for the gateway's servicer and for its client (gateway.client). Field names follow the
protos; no policy here. (The gateway's calls to decode instances speak decode_service.api.)"""
from __future__ import annotations

import json

from common.service.common_api import (
    FINISH_REASON_TO_PB,
    finish_reason_from_pb,
    logprobs_from_pb,
    logprobs_to_pb,
    sampling_params_from_pb,
)
from common.service.embedding_api import pooling_params_from_pb
from common.service.errors import invalid
from common.text.chat_template import ChatTemplateOptions
from gateway.types import (
    BeamSearchResult,
    BeamSearchSequence,
    DeploymentInfo,
    EmbeddingResult,
    EmbedInput,
    GenerateInput,
    GenerationDelta,
    Usage,
)
from protos.pdserve.v1 import generate_pb2


def generate_input_from_pb(msg: generate_pb2.GenerateRequest) -> GenerateInput:
    sampling = sampling_params_from_pb(msg.sampling, field_path="sampling.")
    request = GenerateInput(sampling=sampling, request_id=msg.request_id, priority=msg.priority,
                            return_token_ids=msg.output.return_token_ids,
                            return_logprobs=msg.output.return_logprobs, model=msg.model,
                            split_reasoning=msg.output.split_reasoning)
    _set_prompt(request, msg)
    return request


def beam_search_input_from_pb(msg: generate_pb2.BeamSearchRequest) -> tuple[GenerateInput, int, float | None]:
    """(the request, beam_width, length_penalty or None when unset)."""
    return (generate_input_from_pb(msg.request), msg.beam_width,
            msg.length_penalty if msg.HasField("length_penalty") else None)


def beam_search_result_to_pb(result: BeamSearchResult) -> generate_pb2.BeamSearchResponse:
    return generate_pb2.BeamSearchResponse(
        request_id=result.request_id,
        sequences=[generate_pb2.BeamSequence(text=s.text, token_ids=s.token_ids, cum_logprob=s.cum_logprob,
                                             finish_reason=FINISH_REASON_TO_PB[s.finish_reason])
                   for s in result.sequences],
        usage=generate_pb2.Usage(prompt_tokens=result.usage.prompt_tokens,
                                 completion_tokens=result.usage.completion_tokens))


def beam_search_result_from_pb(msg: generate_pb2.BeamSearchResponse) -> BeamSearchResult:
    return BeamSearchResult(
        request_id=msg.request_id,
        sequences=[BeamSearchSequence(text=s.text, token_ids=list(s.token_ids), cum_logprob=s.cum_logprob,
                                      finish_reason=finish_reason_from_pb(s.finish_reason)) for s in msg.sequences],
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens))


def _set_prompt(request: GenerateInput | EmbedInput,
                msg: generate_pb2.GenerateRequest | generate_pb2.EmbeddingRequest) -> None:
    form = msg.WhichOneof("prompt")
    if form == "text":
        request.text = msg.text
    elif form == "token_ids":
        request.token_ids = list(msg.token_ids.ids)
    elif form == "messages":
        request.messages = [chat_message_from_pb(m) for m in msg.messages.messages]
        request.chat_options = chat_options_from_pb(msg.messages)
    if msg.HasField("add_special_tokens"):
        request.add_special_tokens = msg.add_special_tokens
    if msg.HasField("cache_salt"):
        request.cache_salt = msg.cache_salt


def embed_input_from_pb(msg: generate_pb2.EmbeddingRequest) -> EmbedInput:
    request = EmbedInput(pooling=pooling_params_from_pb(msg.pooling), request_id=msg.request_id,
                         priority=msg.priority, model=msg.model,
                         truncate_prompt_tokens=(msg.truncate_prompt_tokens if msg.HasField("truncate_prompt_tokens")
                                                 else None))
    _set_prompt(request, msg)
    return request


def embedding_result_to_pb(result: EmbeddingResult) -> generate_pb2.EmbeddingResponse:
    return generate_pb2.EmbeddingResponse(
        request_id=result.request_id, embedding=result.embedding, instance_id=result.instance_id,
        usage=generate_pb2.Usage(prompt_tokens=result.usage.prompt_tokens,
                                 cached_prompt_tokens=result.usage.cached_prompt_tokens))


def embedding_result_from_pb(msg: generate_pb2.EmbeddingResponse) -> EmbeddingResult:
    return EmbeddingResult(request_id=msg.request_id, embedding=list(msg.embedding),
                           usage=Usage(msg.usage.prompt_tokens, 0, msg.usage.cached_prompt_tokens),
                           instance_id=msg.instance_id)


def chat_message_from_pb(msg: generate_pb2.ChatMessage) -> dict:
    message = {"role": msg.role, "content": msg.content}
    if msg.name:
        message["name"] = msg.name
    if msg.tool_call_id:
        message["tool_call_id"] = msg.tool_call_id
    if msg.reasoning:
        message["reasoning"] = msg.reasoning
    if msg.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in msg.tool_calls]
    return message


def chat_message_to_pb(message: dict) -> generate_pb2.ChatMessage:
    msg = generate_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                   name=message.get("name") or "", tool_call_id=message.get("tool_call_id") or "",
                                   reasoning=message.get("reasoning") or message.get("reasoning_content") or "")
    for call in message.get("tool_calls") or ():
        function = call.get("function", {})
        msg.tool_calls.add(id=call.get("id", ""), name=function.get("name", ""),
                           arguments=function.get("arguments", ""))
    return msg


def _json_field(text: str, field: str):
    try:
        return json.loads(text) if text else None
    except ValueError as e:
        raise invalid(f"messages.{field}: not JSON: {e}") from None


def chat_options_from_pb(msg: generate_pb2.ChatMessages) -> ChatTemplateOptions:
    try:
        return ChatTemplateOptions(
            add_generation_prompt=msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True,
            continue_final_message=msg.continue_final_message,
            chat_template_kwargs=_json_field(msg.chat_template_kwargs_json, "chat_template_kwargs_json"),
            tools=_json_field(msg.tools_json, "tools_json"),
            documents=_json_field(msg.documents_json, "documents_json"),
            chat_template=msg.chat_template if msg.HasField("chat_template") else None)
    except ValueError as e:  # ChatTemplateOptions names the field
        raise invalid(f"messages.{e}") from None


def chat_options_to_pb(options: ChatTemplateOptions, msg: generate_pb2.ChatMessages) -> None:
    if not options.add_generation_prompt:
        msg.add_generation_prompt = False
    msg.continue_final_message = options.continue_final_message
    if options.chat_template_kwargs:
        msg.chat_template_kwargs_json = json.dumps(options.chat_template_kwargs)
    if options.tools:
        msg.tools_json = json.dumps(options.tools)
    if options.documents:
        msg.documents_json = json.dumps(options.documents)
    if options.chat_template is not None:
        msg.chat_template = options.chat_template


def delta_to_pb(delta: GenerationDelta) -> generate_pb2.GenerateResponse:
    # Runs once per streamed token: fields left at their defaults are not set at all.
    msg = generate_pb2.GenerateResponse(request_id=delta.request_id, text=delta.text,
                                        decode_instance_id=delta.decode_instance_id)
    usage = msg.usage
    usage.prompt_tokens = delta.usage.prompt_tokens
    usage.completion_tokens = delta.usage.completion_tokens
    usage.cached_prompt_tokens = delta.usage.cached_prompt_tokens
    if delta.prefill_instance_id:
        msg.prefill_instance_id = delta.prefill_instance_id
    if delta.token_ids:
        msg.token_ids.extend(delta.token_ids)
    if delta.logprobs:
        msg.logprobs.extend(logprobs_to_pb(token_id, lp) for token_id, lp in delta.logprobs)
    if delta.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_pb(token_id, lp) for token_id, lp in delta.prompt_logprobs)
    if delta.prompt_token_ids:
        msg.prompt_token_ids.extend(delta.prompt_token_ids)
    if delta.reasoning:
        msg.reasoning = delta.reasoning
    if delta.finish_reason is not None:
        msg.finish_reason = FINISH_REASON_TO_PB[delta.finish_reason]
        if delta.stop_string is not None:
            msg.stop_string = delta.stop_string
        elif delta.stop_token_id is not None:
            msg.stop_token_id = delta.stop_token_id
    return msg


def deployment_info_to_pb(info: DeploymentInfo) -> generate_pb2.ModelInfoResponse:
    return generate_pb2.ModelInfoResponse(
        model_name=info.model_name, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        block_size=info.block_size, eos_token_ids=info.eos_token_ids,
        has_chat_template=info.has_chat_template, num_prefill_instances=info.num_prefill_instances,
        num_decode_instances=info.num_decode_instances, placement_policy=info.placement_policy)


# The client's side of the same messages.

def delta_from_pb(msg: generate_pb2.GenerateResponse) -> GenerationDelta:
    stop_reason = msg.WhichOneof("stop_reason")
    return GenerationDelta(
        request_id=msg.request_id, text=msg.text, token_ids=list(msg.token_ids),
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens),
        logprobs=[logprobs_from_pb(lp) for lp in msg.logprobs],
        prompt_logprobs=[logprobs_from_pb(lp) for lp in msg.prompt_logprobs],
        prompt_token_ids=list(msg.prompt_token_ids), reasoning=msg.reasoning,
        finish_reason=finish_reason_from_pb(msg.finish_reason),
        stop_token_id=msg.stop_token_id if stop_reason == "stop_token_id" else None,
        stop_string=msg.stop_string if stop_reason == "stop_string" else None,
        prefill_instance_id=msg.prefill_instance_id, decode_instance_id=msg.decode_instance_id)


def deployment_info_from_pb(msg: generate_pb2.ModelInfoResponse) -> DeploymentInfo:
    return DeploymentInfo(
        model_name=msg.model_name, max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
        block_size=msg.block_size, eos_token_ids=tuple(msg.eos_token_ids),
        has_chat_template=msg.has_chat_template, num_prefill_instances=msg.num_prefill_instances,
        num_decode_instances=msg.num_decode_instances, placement_policy=msg.placement_policy)
