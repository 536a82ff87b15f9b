"""OpenAI request bodies -> GenerateInputs, checked field by field at the edge.

Every problem is a 400 whose message and `param` name the field: malformed JSON, a
field this API does not know (strict, so a typo is not silently ignored), a wrong
type, a value out of range. The fields accepted are OpenAI's, the sampling
extensions vLLM accepts (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, allowed_token_ids, prompt_logprobs, include_stop_str_in_output,
skip_special_tokens, priority, stream_options.continuous_usage_stats, and the output
constraints: response_format, guided_json/regex/choice/grammar, structured_outputs; see
structured_outputs.py), vLLM's other extensions (use_beam_search and length_penalty,
return_token_ids, chat template options and a request's own chat_template, bad_words,
truncate_prompt_tokens, cache_salt ...), tools (tools.py), and OpenAI fields for features this server
does not have (suffix, audio, ...) as long as they hold their neutral value (unset, null, empty): a request that
asks for such a feature gets a 400 instead of an answer that silently lacks it. `user`,
`metadata` and the like are type-checked and otherwise ignored.

n and a list of prompts are fanned out here: one GenerateInput per choice, choice
index = prompt index * n + sample index (OpenAI's order), sample i seeded seed + i.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.engine.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from common.engine.block_hash import MAX_CACHE_SALT_CHARS, check_cache_salt
from common.engine.generation_config import SamplingDefaults
from common.engine.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from common.engine.structured_output.params import StructuredOutputsParams
from common.text.chat_template import (
    DEFAULT_CHAT_TEMPLATE_OPTIONS,
    MAX_CHAT_TEMPLATE_CHARS,
    MAX_CHAT_TEMPLATE_KWARGS,
    MAX_DOCUMENTS,
    ChatTemplateOptions,
)
from gateway.beam_search import unsupported_sampling_field
from gateway.openai_api.errors import ApiError, invalid_field
from gateway.openai_api.structured_outputs import FIELDS as STRUCTURED_OUTPUT_FIELDS
from gateway.openai_api.structured_outputs import structured_outputs_of
from gateway.openai_api.tool_parsers import ToolCallParser
from gateway.openai_api.tools import FIELDS as TOOL_FIELDS
from gateway.openai_api.tools import (
    MAX_TOOL_CALLS_PER_MESSAGE,
    TOOL_CALL_SCHEMA,
    ToolChoice,
    checked_tools,
    message_tool_fields,
    tool_choice_of,
)
from gateway.types import EmbedInput, GenerateInput
from gateway.validation import MAX_CHAT_MESSAGES

MAX_CHOICES = 128  # n times the number of prompts: OpenAI's own cap on n
NO_DEFAULTS = SamplingDefaults()
# Integer fields are bounded by the width of the protobuf field they travel in to the
# instances (common.proto's SamplingParams): a larger value was a ValueError and a 500.
INT32 = (-2**31, 2**31 - 1)
UINT32_MAX = 2**32 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_NONE = object()  # a field that was not sent
# The body's shape before its fields are looked at. The deepest body this API takes
# nests 5 levels (messages[i].content[j].text); the bound leaves room for metadata and
# keeps the parser far from Python's recursion limit (a RecursionError was a 500).
MAX_JSON_DEPTH = 32
# Every integer field fits in 64 bits (seed < 2**63 has 19 digits); longer literals are
# refused while parsing, before int() spends quadratic time on them (5,000 digits was a 500).
MAX_INTEGER_DIGITS = 20
# Strings are matched whole so that brackets inside them are skipped.
_STRINGS_AND_BRACKETS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


@dataclass
class ParsedRequest:
    chat: bool
    model: str
    sampling: SamplingParams  # n: choices per prompt
    prompts: list[str | list[int]] | None = None  # completions
    messages: list[dict] | None = None  # chat, content joined into a string
    stream: bool = False
    include_usage: bool = False  # stream: a last chunk with the usage
    continuous_usage: bool = False  # stream: usage so far in every chunk (vLLM)
    num_logprobs: int | None = None  # top alternatives per token; None: no logprobs
    # Completions: the prompt's text before each choice's, and with logprobs its tokens' first
    echo: bool = False
    priority: int = 0
    constraint_field: str | None = None  # the field that set the output constraint, if any
    chat_options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS
    add_special_tokens: bool | None = None  # None: the prompt form's default
    # Chat: who the answer speaks as (the last message's role when no generation prompt
    # is added, as vLLM), and with echo the text every choice's content starts with.
    response_role: str = "assistant"
    chat_echo: str = ""
    tool_choice: ToolChoice | None = None  # chat: the tools sent and the call they force, if any
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's)
    return_token_ids: bool = False  # the prompt's and each choice's token ids beside the text (vLLM's)
    include_reasoning: bool = True  # chat: the reasoning parser's `reasoning` in the answer (vLLM's)
    beam_search: BeamSearchParams | None = None  # use_beam_search: n beams instead of n samples
    cache_salt: str | None = None  # only requests of the same salt share prefix-cache blocks (vLLM's)

    @property
    def forced_tool_call(self) -> bool:
        return self.tool_choice is not None and self.tool_choice.forced is not None

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) if self.prompts is not None else 1

    def generate_inputs(self, request_id: str) -> list[GenerateInput]:
        """One GenerateInput per choice, in choice order; ids request_id[-index]."""
        n = self.sampling.n
        inputs = []
        for prompt in self.prompts if self.prompts is not None else [None]:
            for sample in range(n):
                index = len(inputs)
                request = GenerateInput(
                    sampling=self.sampling.for_child(sample),
                    request_id=request_id if self.num_prompts * n == 1 else f"{request_id}-{index}",
                    priority=self.priority, return_logprobs=self.num_logprobs is not None, model=self.model,
                    add_special_tokens=self.add_special_tokens, return_token_ids=self.return_token_ids,
                    cache_salt=self.cache_salt)
                set_prompt(request, prompt, self.messages, self.chat_options)
                inputs.append(request)
        return inputs


def set_prompt(request: GenerateInput | EmbedInput, prompt: str | list[int] | None, messages: list[dict] | None,
               chat_options: ChatTemplateOptions) -> None:
    """The request's prompt: the conversation where messages are given (rendered with
    chat_options), else a completion-style prompt (checked_prompts') as its text or token ids."""
    if messages is not None:
        request.messages, request.chat_options = messages, chat_options
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids = prompt


# --- value checks: each takes (param, value) and returns the value to use ------------
# Each also carries `json_schema`: what it accepts, as JSON Schema, from which openapi.py
# writes the API's OpenAPI document, so the document cannot drift from the checks.

def described(schema: dict) -> Callable[[Callable], Callable]:
    """Attach to a check the JSON Schema of the values it accepts."""
    def attach(check: Callable) -> Callable:
        check.json_schema = schema
        return check
    return attach


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def _wrong_type(param: str, expected: str, value: Any) -> ApiError:
    return invalid_field(param, f"must be {expected}, got {_type_name(value)}", code="invalid_type")


def integer(lo: int | None = None, hi: int | None = None, allowed: str = "") -> Callable:
    def check(param: str, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            # 3.0 from a client that writes every number as a float is still an integer.
            if not (isinstance(value, float) and value.is_integer()):
                raise _wrong_type(param, "an integer", value)
            value = int(value)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise invalid_field(param, f"must be {allowed or _range(lo, hi)}, got {value}")
        return value
    bounds = {**({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}
    return described({"type": "integer", **bounds})(check)


@described({"type": "number"})
def finite_number(param: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _wrong_type(param, "a number", value)
    if not math.isfinite(value):
        raise invalid_field(param, f"must be a finite number, got {value}")
    return float(value)


def number(lo: float, hi: float, lo_open: bool = False) -> Callable:
    def check(param: str, value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _wrong_type(param, "a number", value)
        if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
            low = f"({lo}" if lo_open else f"[{lo}"
            high = "inf)" if math.isinf(hi) else f"{hi}]"
            raise invalid_field(param, f"must be in {low}, {high}, got {value}")
        return float(value)
    schema = {"type": "number", "exclusiveMinimum" if lo_open else "minimum": lo}
    if not math.isinf(hi):
        schema["maximum"] = hi
    return described(schema)(check)


def _range(lo: int | None, hi: int | None) -> str:
    if hi is None:
        return f">= {lo}"
    return f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"


@described({"type": "boolean"})
def boolean(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _wrong_type(param, "a boolean", value)
    return value


@described({"type": "string"})
def string(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _wrong_type(param, "a string", value)
    return value


@described({"type": "object"})
def obj(param: str, value: Any) -> dict:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object", value)
    return value


def _at_most(param: str, values: list, limit: int, what: str) -> None:
    """Counted before any element is checked, so an oversized list costs nothing more."""
    if len(values) > limit:
        raise invalid_field(param, f"must hold at most {limit} {what}, got {len(values)}")


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}


@described({"anyOf": [_STOP_STRING, {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _STOP_STRING}]})
def stop_strings(param: str, value: Any) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list):
        raise _wrong_type(param, "a string or an array of strings", value)
    _at_most(param, values, MAX_STOP_STRINGS, "strings")
    for i, s in enumerate(values):
        if not isinstance(s, str):
            raise _wrong_type(f"{param}[{i}]", "a string", s)
        if not s:
            raise invalid_field(f"{param}[{i}]", "must not be empty")
    return values


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0},
              "description": "token ids of the served model's vocabulary"}


@described(_TOKEN_IDS)
def token_id_list(param: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise _wrong_type(param, "an array of token ids", value)
    check = integer(0, UINT32_MAX)
    return [check(f"{param}[{i}]", t) for i, t in enumerate(value)]


@described({"type": "array", "maxItems": MAX_BAD_WORDS,
            "items": {"type": "string", "minLength": 1, "maxLength": MAX_BAD_WORD_CHARS},
            "description": "words the output may not contain (vLLM's); each at most "
                           f"{MAX_BAD_WORD_TOKENS} tokens"})
def bad_words(param: str, value: Any) -> list[str]:
    """Checked by SamplingParams (and tokenized by the gateway)."""
    if not isinstance(value, list):
        raise _wrong_type(param, "an array of strings", value)
    return value


@described({**_TOKEN_IDS, "maxItems": MAX_STOP_TOKEN_IDS})
def stop_token_ids(param: str, value: Any) -> list[int]:
    if isinstance(value, list):
        _at_most(param, value, MAX_STOP_TOKEN_IDS, "token ids")
    return token_id_list(param, value)


@described({**_TOKEN_IDS, "minItems": 1, "maxItems": MAX_ALLOWED_TOKEN_IDS})
def allowed_token_ids(param: str, value: Any) -> list[int]:
    if isinstance(value, list):
        _at_most(param, value, MAX_ALLOWED_TOKEN_IDS, "token ids")
        if not value:
            raise invalid_field(param, "must not be empty; leave it unset to allow every token")
    return token_id_list(param, value)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


@described({"type": "object", "maxProperties": MAX_LOGIT_BIAS_TOKENS,
            "propertyNames": {"pattern": "^[0-9]{1,10}$"},
            "additionalProperties": {"type": "number", "minimum": -MAX_ABS_LOGIT_BIAS, "maximum": MAX_ABS_LOGIT_BIAS},
            "description": "token id (as a string, OpenAI's form) -> a bias added to that token's logit at every "
                           "step; -100 all but bans the token, 100 all but forces it"})
def logit_bias(param: str, value: Any) -> dict[int, float]:
    if not isinstance(value, dict):
        raise _wrong_type(param, "an object of token id -> bias", value)
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise invalid_field(param, f"must hold at most {MAX_LOGIT_BIAS_TOKENS} token ids, got {len(value)}")
    check_bias = number(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)
    biases = {}
    for key, bias in value.items():
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > UINT32_MAX:
            raise invalid_field(param, f"keys must be token ids written as strings (\"50256\"), got {key[:40]!r}")
        token_id = int(key)
        if token_id in biases:  # "7" and "07"
            raise invalid_field(param, f"names token id {token_id} twice")
        biases[token_id] = check_bias(f"{param}.{key}", bias)
    return biases


@described({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS, "pattern": r"^[^@/\\\u0000]*$",
            "description": "prefix-cache salt: cached blocks are shared only with requests of the same salt"})
def cache_salt(param: str, value: Any) -> str:
    try:
        return check_cache_salt(string(param, value))
    except ValueError as e:
        raise invalid_field(param, str(e).removeprefix("cache_salt ")) from None


def neutral(*values: Any) -> Callable:
    """A field for a feature this server lacks: only its do-nothing values pass."""
    def check(param: str, value: Any) -> Any:
        if value not in values:
            shown = "".join(f" or {json.dumps(v)}" for v in values)
            raise invalid_field(param, f"is not supported by this server; leave it unset{shown}",
                                code="unsupported_value")
        return value
    # Unset (null) always passes; with no other value, null is all there is.
    return described({"enum": list(values)} if values else {"type": "null"})(check)


_PROMPT_TOKEN_IDS = {**_TOKEN_IDS, "minItems": 1}
_PROMPT_TEXT = {"type": "string", "minLength": 1}


@described({"anyOf": [_PROMPT_TEXT, _PROMPT_TOKEN_IDS, {
    "type": "array", "minItems": 1, "items": {"anyOf": [_PROMPT_TEXT, _PROMPT_TOKEN_IDS]}}],
    "description": f"a prompt (text or token ids) or a list of them; n times the number of prompts is at "
                   f"most {MAX_CHOICES}; prompt text at most --max-prompt-chars, token ids at most "
                   f"max_model_len - 1"})
def prompt_value(param: str, value: Any) -> Any:
    """Checked whole by checked_prompts once the other fields are known."""
    return value


_TEXT_PART = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
              "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}}}


_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_NAME = {"type": ["string", "null"]}  # an optional string


def _turn(roles: list[str], required: list[str], **properties: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["role", *required],
            "properties": {"role": {"enum": roles}, "name": _NAME, **properties}}


@described({"type": "array", "minItems": 1, "maxItems": MAX_CHAT_MESSAGES, "items": {"anyOf": [
    _turn(["system", "developer", "user"], ["content"], content=_CONTENT),
    _turn(["assistant"], ["content"], content=_CONTENT, reasoning=_NAME, reasoning_content=_NAME),
    _turn(["assistant"], ["tool_calls"], content={"anyOf": [_CONTENT, {"type": "null"}]},
          reasoning=_NAME, reasoning_content=_NAME,
          tool_calls={"type": "array", "minItems": 1, "maxItems": MAX_TOOL_CALLS_PER_MESSAGE,
                      "items": TOOL_CALL_SCHEMA}),
    _turn(["tool"], ["content", "tool_call_id"], content=_CONTENT, tool_call_id={"type": "string"})]},
    "description": "the conversation; its content at most --max-prompt-chars in total"})
def messages_value(param: str, value: Any) -> Any:
    """Checked whole by checked_messages once the other fields are known."""
    return value


@described({"type": "object", "maxProperties": MAX_CHAT_TEMPLATE_KWARGS,
            "description": "extra variables for the model's chat template, e.g. {\"enable_thinking\": false}; "
                           "not the renderer's own (messages, add_generation_prompt ...)"})
def template_kwargs(param: str, value: Any) -> dict:
    """Checked whole by ChatTemplateOptions."""
    return obj(param, value)


@described({"type": "array", "maxItems": MAX_DOCUMENTS,
            "items": {"type": "object", "additionalProperties": {"type": "string"}},
            "description": "documents for retrieval-augmented chat templates, e.g. [{\"title\": ..., \"text\": ...}]"})
def documents(param: str, value: Any) -> list:
    """Checked whole by ChatTemplateOptions."""
    if not isinstance(value, list):
        raise _wrong_type(param, "an array of objects", value)
    return value


@described({"type": "string", "minLength": 1, "maxLength": MAX_CHAT_TEMPLATE_CHARS,
            "description": "a Jinja chat template for this request (the gateway must run with "
                           "--trust-request-chat-template)"})
def chat_template_text(param: str, value: Any) -> str:
    """Checked whole by ChatTemplateOptions."""
    return string(param, value)


COMMON_FIELDS: dict[str, Callable] = {
    "model": string, "stream": boolean, "stream_options": obj, "n": integer(1, MAX_CHOICES),
    "max_tokens": integer(1, UINT32_MAX), "temperature": number(0.0, 2.0), "top_p": number(0.0, 1.0, lo_open=True),
    "top_k": integer(-1, INT32[1], allowed=f"-1 or 0 (disabled) or an integer in [1, {INT32[1]}]"),
    "min_p": number(0.0, 1.0),
    "presence_penalty": number(-2.0, 2.0), "frequency_penalty": number(-2.0, 2.0),
    "repetition_penalty": number(0.0, math.inf, lo_open=True), "seed": integer(0, MAX_SEED),
    "stop": stop_strings, "stop_token_ids": stop_token_ids, "ignore_eos": boolean, "min_tokens": integer(0, UINT32_MAX),
    "include_stop_str_in_output": boolean, "skip_special_tokens": boolean, "priority": integer(*INT32),
    "allowed_token_ids": allowed_token_ids, "prompt_logprobs": integer(0, MAX_LOGPROBS), "user": string,
    "logit_bias": logit_bias, "return_tokens_as_token_ids": boolean, "bad_words": bad_words,
    "truncate_prompt_tokens": integer(-1, INT32[1], allowed=f"-1 (the model's maximum length) or an integer in "
                                                            f"[1, {INT32[1]}]"),
    "use_beam_search": boolean, "length_penalty": finite_number, "return_token_ids": boolean,
    "cache_salt": cache_salt, **STRUCTURED_OUTPUT_FIELDS,
}
COMPLETION_FIELDS: dict[str, Callable] = {
    **COMMON_FIELDS, "prompt": prompt_value, "logprobs": integer(0, MAX_LOGPROBS),
    "echo": boolean, "best_of": integer(1, MAX_CHOICES), "suffix": neutral(""), "add_special_tokens": boolean}
CHAT_FIELDS: dict[str, Callable] = {
    **COMMON_FIELDS, "messages": messages_value, "max_completion_tokens": integer(1, UINT32_MAX),
    "logprobs": boolean, "top_logprobs": integer(0, MAX_LOGPROBS),
    **TOOL_FIELDS,
    "functions": neutral([]), "function_call": neutral("none"), "parallel_tool_calls": boolean,
    "modalities": neutral(["text"]), "audio": neutral(), "prediction": neutral(), "reasoning_effort": neutral(),
    "web_search_options": neutral(), "store": neutral(False), "metadata": obj, "service_tier": string,
    "prompt_cache_key": string, "safety_identifier": string, "verbosity": neutral(),
    "echo": boolean, "add_generation_prompt": boolean, "continue_final_message": boolean, "include_reasoning": boolean,
    "chat_template_kwargs": template_kwargs, "add_special_tokens": boolean, "documents": documents,
    "chat_template": chat_template_text}
STREAM_OPTIONS = {"include_usage": boolean, "continuous_usage_stats": boolean, "include_obfuscation": boolean}


@described({"type": "string", "minLength": 1, "description": "text, tokenized as a completion's prompt is"})
def prompt_text(param: str, value: Any) -> str:
    if not string(param, value):
        raise invalid_field(param, "must not be empty")
    return value


TOKENIZE_FIELDS: dict[str, Callable] = {
    "model": string, "prompt": prompt_text, "messages": messages_value, "add_special_tokens": boolean,
    "add_generation_prompt": boolean, "continue_final_message": boolean, "chat_template_kwargs": template_kwargs,
    "tools": TOOL_FIELDS["tools"], "documents": documents, "chat_template": chat_template_text,
    "return_token_strs": boolean}
DETOKENIZE_FIELDS: dict[str, Callable] = {"model": string, "tokens": token_id_list}


@dataclass
class TokenizeRequest:
    """POST /tokenize (vLLM's): a prompt or chat messages, tokenized as generation would."""
    model: str | None
    prompt: GenerateInput  # text or messages, with their tokenization options
    return_token_strs: bool = False  # each token's text beside its id


_CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
                     "documents", "chat_template")


def parse_tokenize_request(body: bytes) -> TokenizeRequest:
    values = checked_fields(parse_body(body), TOKENIZE_FIELDS)
    forms = [name for name in ("prompt", "messages") if name in values]
    if len(forms) != 1:
        raise invalid_field("prompt", "set exactly one of prompt and messages",
                            code="missing_field" if not forms else "invalid_value")
    prompt = GenerateInput(add_special_tokens=values.get("add_special_tokens"))
    if "messages" in values:
        tools = checked_tools(values["tools"]) if "tools" in values else None  # listed as generation lists them
        prompt.messages = checked_messages(values["messages"])
        prompt.chat_options = chat_options_of(values, tools or None)
    else:
        unused = next((name for name in _CHAT_ONLY_FIELDS if name in values), None)
        if unused is not None:
            raise invalid_field(unused, "only applies to messages")
        prompt.text = values["prompt"]
    return TokenizeRequest(model=values.get("model"), prompt=prompt,
                           return_token_strs=values.get("return_token_strs", False))


def parse_detokenize_request(body: bytes) -> tuple[str | None, list[int]]:
    """POST /detokenize (vLLM's): (model or None, token ids)."""
    values = checked_fields(parse_body(body), DETOKENIZE_FIELDS)
    if "tokens" not in values:
        raise invalid_field("tokens", "is required", code="missing_field")
    return values.get("model"), values["tokens"]


class _IntegerTooLong(ValueError):
    pass


def _bounded_int(literal: str) -> int:
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INTEGER_DIGITS:
        raise _IntegerTooLong(digits)
    return int(literal)


def _too_deep(body: bytes) -> bool:
    """Whether arrays and objects nest more than MAX_JSON_DEPTH deep (a linear scan, run
    only when there are enough brackets for it to be possible)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return False
    depth = 0
    for match in _STRINGS_AND_BRACKETS.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False


def parse_body(body: bytes) -> dict:
    if _too_deep(body):
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")
    try:
        data = json.loads(body, parse_int=_bounded_int)
    except _IntegerTooLong as e:
        raise ApiError(400, f"the request body has an integer of {e.args[0]} digits; at most "
                            f"{MAX_INTEGER_DIGITS} are allowed (every integer field fits in 64 bits)",
                       code="invalid_json") from None
    except RecursionError:  # only if the depth scan and the parser ever disagree
        raise ApiError(400, "the request body nests arrays and objects too deeply", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_type_name(data)}",
                       code="invalid_json")
    return data


def checked_fields(data: dict, fields: dict[str, Callable], where: str = "") -> dict[str, Any]:
    """The fields' checked values; null counts as unset (OpenAI's optional fields are nullable)."""
    unknown = [name for name in data if name not in fields]
    if unknown:
        param = where + unknown[0]
        raise invalid_field(param, f"unknown field; this API accepts {', '.join(sorted(fields))}",
                            code="unknown_field")
    return {name: fields[name](where + name, value) for name, value in data.items() if value is not None}


def parse_request(body: bytes, chat: bool, tool_parser: ToolCallParser | None = None,
                  response_role: str = "assistant", defaults: SamplingDefaults = NO_DEFAULTS) -> ParsedRequest:
    """A completions or chat body, checked; `tool_parser`: the server's for tool_choice "auto";
    `response_role`: the role a chat answer speaks as after a generation prompt (--response-role);
    `defaults`: the model's sampling where the request leaves a field unset, and its bound on
    max_tokens (--generation-config; a beam search takes only the bound, as it samples nothing)."""
    values = checked_fields(parse_body(body), CHAT_FIELDS if chat else COMPLETION_FIELDS)
    if not values.get("use_beam_search", False):
        values = {**defaults.sampling, **values}
    get = values.get
    if "model" not in values:
        raise invalid_field("model", "is required: the name /v1/models lists", code="missing_field")
    stream = get("stream", False)
    options = checked_fields(get("stream_options", {}), STREAM_OPTIONS, "stream_options.")
    if "stream_options" in values and not stream:
        raise invalid_field("stream_options", "is only allowed when stream is true")
    n = get("n", 1)
    parsed = ParsedRequest(chat=chat, model=values["model"], sampling=SamplingParams(), stream=stream,
                           include_usage=options.get("include_usage", False),
                           continuous_usage=options.get("continuous_usage_stats", False),
                           priority=get("priority", 0),
                           return_tokens_as_token_ids=get("return_tokens_as_token_ids", False),
                           return_token_ids=get("return_token_ids", False), cache_salt=get("cache_salt"))
    if chat:
        parsed.messages = checked_messages(values.get("messages", _NONE))
        max_tokens = _chat_max_tokens(values)
        if "top_logprobs" in values and not get("logprobs", False):
            raise invalid_field("top_logprobs", "needs logprobs set to true")
        parsed.num_logprobs = get("top_logprobs", 0) if get("logprobs", False) else None
        parsed.tool_choice = tool_choice_of(values, tool_parser)
        parsed.include_reasoning = get("include_reasoning", True)
        parsed.chat_options = chat_options_of(values, parsed.tool_choice.tools if parsed.tool_choice else None)
        last = parsed.messages[-1]
        parsed.response_role = response_role if parsed.chat_options.add_generation_prompt else last["role"]
        if get("echo", False) and last["role"] == parsed.response_role:
            if parsed.forced_tool_call:
                raise invalid_field("echo", "cannot be used with a forced tool call (the answer is tool_calls, "
                                            "not content)")
            parsed.chat_echo = last["content"]
    else:
        parsed.prompts = checked_prompts(values.get("prompt", _NONE))
        max_tokens = get("max_tokens", 16)  # OpenAI's default for completions
        parsed.num_logprobs = get("logprobs")
        parsed.echo = get("echo", False)
        if get("best_of", n) != n:
            raise invalid_field("best_of", f"must equal n ({n}) if set: ranking candidates is not supported",
                                code="unsupported_value")
    if defaults.max_tokens is not None:
        max_tokens = min(max_tokens or defaults.max_tokens, defaults.max_tokens)
    if n * parsed.num_prompts > MAX_CHOICES:
        raise invalid_field("n", f"n ({n}) times the number of prompts ({parsed.num_prompts}) must be at most "
                                 f"{MAX_CHOICES}")
    parsed.add_special_tokens = get("add_special_tokens")
    constraint, parsed.constraint_field = structured_outputs_of(values)
    if parsed.forced_tool_call:
        if constraint is not None:
            raise invalid_field("tool_choice", f"conflicts with {parsed.constraint_field}: a forced tool call "
                                               f"constrains the output already")
        constraint, parsed.constraint_field = parsed.tool_choice.constraint, "tools"
    parsed.sampling = _sampling(values, n, max_tokens, parsed.num_logprobs, constraint)
    parser = parsed.tool_choice.parser if parsed.tool_choice is not None else None
    if parser is not None and parser.keeps_special_tokens:  # its marker is a special token (Mistral's)
        parsed.sampling = parsed.sampling.clone(skip_special_tokens=False)
    if parsed.echo and parsed.num_logprobs is not None:  # the echoed prompt's tokens have logprobs too
        parsed.sampling = parsed.sampling.clone(
            prompt_logprobs=max(parsed.sampling.prompt_logprobs or 0, parsed.num_logprobs))
    if get("use_beam_search", False):
        parsed.beam_search = _beam_search(values, parsed)
    elif "length_penalty" in values:
        raise invalid_field("length_penalty", "only applies with use_beam_search")
    return parsed


def _beam_search(values: dict, parsed: ParsedRequest) -> BeamSearchParams:
    """vLLM's use_beam_search: the request's n is the beam width. What a search cannot honour
    (streaming, logprobs, echo, a constraint, the sampling fields that shape a draw) is a 400."""
    def refuse(param: str, what: str = "is not supported with use_beam_search") -> ApiError:
        return invalid_field(param, what, code="unsupported_value")
    sampling = parsed.sampling
    if parsed.stream:
        raise refuse("stream", "must be false with use_beam_search: the beams are ranked once all have ended")
    if parsed.num_logprobs is not None:
        raise refuse("logprobs")
    if parsed.echo or parsed.chat_echo:
        raise refuse("echo")
    if sampling.structured_outputs is not None:
        raise refuse(parsed.constraint_field or "structured_outputs")
    if sampling.n > MAX_BEAM_WIDTH:
        raise invalid_field("n", f"is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH} (each step "
                                 f"reads 2 * n logprobs, at most {MAX_LOGPROBS}), got {sampling.n}")
    unsupported = unsupported_sampling_field(sampling)
    if unsupported is not None:
        raise refuse(unsupported)
    return BeamSearchParams(beam_width=sampling.n, max_tokens=sampling.max_tokens,
                            length_penalty=values.get("length_penalty", 1.0), ignore_eos=sampling.ignore_eos,
                            include_stop_str_in_output=sampling.include_stop_str_in_output,
                            skip_special_tokens=sampling.skip_special_tokens)


def chat_options_of(values: dict, tools: list[dict] | None = None) -> ChatTemplateOptions:
    try:
        return ChatTemplateOptions(add_generation_prompt=values.get("add_generation_prompt", True),
                                   continue_final_message=values.get("continue_final_message", False),
                                   chat_template_kwargs=values.get("chat_template_kwargs"), tools=tools,
                                   documents=values.get("documents"), chat_template=values.get("chat_template"))
    except ValueError as e:  # it starts with the field, e.g. "chat_template_kwargs.messages: ..."
        param, message = str(e).split(": ", 1)
        raise invalid_field(param, message) from None


def _chat_max_tokens(values: dict) -> int | None:
    """max_completion_tokens is the current name, max_tokens the deprecated one; both
    may be sent, but not with different values."""
    new, old = values.get("max_completion_tokens"), values.get("max_tokens")
    if new is not None and old is not None and new != old:
        raise invalid_field("max_tokens", f"differs from max_completion_tokens ({new}); send one of them")
    return new if new is not None else old  # None: until EOS or the context is full


def _sampling(values: dict, n: int, max_tokens: int | None, num_logprobs: int | None,
              structured_outputs: StructuredOutputsParams | None) -> SamplingParams:
    get = values.get
    names = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "include_stop_str_in_output",
             "skip_special_tokens", "logit_bias", "allowed_token_ids", "prompt_logprobs", "truncate_prompt_tokens",
             "bad_words")
    fields = {name: values[name] for name in names if name in values}
    top_k = get("top_k", -1)
    try:
        return SamplingParams(n=n, max_tokens=max_tokens, logprobs=num_logprobs,
                              top_k=-1 if top_k == 0 else top_k, structured_outputs=structured_outputs,
                              **fields)
    except ValueError as e:  # what only holds between fields, e.g. min_tokens <= max_tokens
        message = str(e)
        param = message.split(" ", 1)[0]  # SamplingParams starts with the field, e.g. "stop[2]"
        raise invalid_field(param if param.split("[", 1)[0] in values else "max_tokens", message) from None


def checked_prompts(prompt: Any, field: str = "prompt") -> list[str | list[int]]:
    """A string, an array of strings, an array of token ids, or an array of those (the body's `field`)."""
    if prompt is _NONE:
        raise invalid_field(field, "is required", code="missing_field")
    single = isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt))
    if single:
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        raise invalid_field(field, "must be a non-empty string, array of strings, array of token ids "
                                   "or array of token-id arrays", code="invalid_type")
    for i, item in enumerate(prompts):
        param = field if single else f"{field}[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid_field(param, "must not be empty")
        elif isinstance(item, list) and item:
            token_id_list(param, item)
        else:
            raise invalid_field(param, "must be a non-empty string or array of token ids", code="invalid_type")
    return prompts


def checked_messages(messages: Any) -> list[dict]:
    if messages is _NONE:
        raise invalid_field("messages", "is required", code="missing_field")
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "must be a non-empty array of messages", code="invalid_type")
    _at_most("messages", messages, MAX_CHAT_MESSAGES, "messages")
    checked = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        values = checked_fields(obj(param, message), {"role": string, "content": lambda p, v: v, "name": string,
                                                "tool_calls": lambda p, v: v, "tool_call_id": string,
                                                "reasoning": string, "reasoning_content": string}, f"{param}.")
        role = values.get("role")
        if role not in CHAT_ROLES:
            raise invalid_field(f"{param}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        tool_fields = message_tool_fields(param, role, values)
        content = values.get("content", "" if tool_fields.get("tool_calls") else _NONE)  # null beside calls
        checked.append({"role": "system" if role == "developer" else role,
                        "content": _content(f"{param}.content", content), **tool_fields})
        if "name" in values:
            checked[-1]["name"] = values["name"]
        reasoning = values.get("reasoning", values.get("reasoning_content"))  # the latter: its old name
        if reasoning is not None:
            if role != "assistant":
                raise invalid_field(f"{param}.reasoning", "only an assistant turn has reasoning")
            checked[-1]["reasoning"] = reasoning  # templates that show past thinking read it
    return checked


def _content(param: str, content: Any) -> str:
    """A string, or text parts joined with newlines (what vLLM gives a string-only template)."""
    if isinstance(content, str):
        return content
    if content is _NONE:
        raise invalid_field(param, "is required", code="missing_field")
    if not isinstance(content, list):
        raise _wrong_type(param, "a string or an array of text parts", content)
    texts = []
    for j, part in enumerate(content):
        values = checked_fields(obj(f"{param}[{j}]", part), {"type": string, "text": string}, f"{param}[{j}].")
        if values.get("type") != "text":
            raise invalid_field(f"{param}[{j}].type", f"only 'text' parts are supported, got "
                                                      f"{values.get('type')!r}", code="unsupported_value")
        if "text" not in values:
            raise invalid_field(f"{param}[{j}].text", "is required", code="missing_field")
        texts.append(values["text"])
    return "\n".join(texts)
