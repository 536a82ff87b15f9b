"""Check and tokenize a Generate call before anything is placed: a bad request is
answered here, with INVALID_ARGUMENT and a message naming what to change, and
never reaches a worker.

The served model is described by `ServedModel` (tokenizer + config.json; no
weights). The length limit comes from the caller (the gateway takes the smallest
max_model_len its decode instances registered, else the model's own limit).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

from common.engine.bad_words import with_bad_words_token_ids
from common.engine.block_hash import check_cache_salt
from common.engine.generation_config import SamplingDefaults, load_sampling_defaults
from common.engine.model_files import BUNDLED_MODEL_NAME, load_hf_config, resolve_model
from common.engine.sampling_params import truncate_prompt, validate_prompt_token_ids
from common.service.errors import invalid
from common.text.chat_template import ChatTemplateOptions
from common.text.prompt_tokenizer import load_prompt_tokenizer
from gateway.types import EmbedInput, GenerateInput, PreparedEmbedding, PreparedRequest

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
# Chat messages per request: the chat template runs once per message, on the event
# loop for short conversations. Agent transcripts reach hundreds; their total size is
# bounded separately (max_prompt_chars), so each message's is too.
MAX_CHAT_MESSAGES = 1024


@dataclass
class ServedModel:
    name: str  # what ModelInfo reports until an instance registers its own name
    aliases: frozenset[str]  # names a request's `model` field may use
    model_dir: Path
    tokenizer: object  # common.text.prompt_tokenizer.PromptTokenizer or common.text.tokenizer.Tokenizer
    max_position_embeddings: int  # the model's own length limit
    vocab_size: int  # ids the model's embedding accepts (config.json)
    # Template variables every chat request gets unless it sets them (--default-chat-template-kwargs)
    default_chat_template_kwargs: dict | None = None
    # Whether a request may bring its own chat template (--trust-request-chat-template): a
    # template is code the renderer runs, sandboxed, so a server takes them only when told to.
    trust_request_chat_template: bool = False
    # --served-model-name's names after the first, each listed by /v1/models as vLLM lists them
    other_served_names: tuple[str, ...] = ()
    # The model's recommended sampling, for HTTP requests that leave a field unset
    # (--generation-config, --override-generation-config).
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    @property
    def has_chat_template(self) -> bool:
        hf_tokenizer = getattr(self.tokenizer, "hf_tokenizer", None)
        return bool(getattr(self.tokenizer, "chat_template", None) or getattr(hf_tokenizer, "chat_template", None))


def load_served_model(model: str | None, served_model_name: str | list[str] | None = None,
                      chat_template: str | None = None,
                      default_chat_template_kwargs: dict | None = None,
                      trust_request_chat_template: bool = False, generation_config: str = "auto",
                      override_generation_config: dict | None = None) -> ServedModel:
    """The tokenizer and limits of `model`, named as the instances name it
    (common.service.flags.served_model_name: --served-model-name, else --model). chat_template:
    a Jinja template (or a file holding one) used instead of the model's own.
    generation_config / override_generation_config: where requests' sampling defaults come
    from (common.engine.generation_config)."""
    model_dir = resolve_model(model)
    sampling_defaults = load_sampling_defaults(model_dir, generation_config, override_generation_config)
    if sampling_defaults:  # as vLLM says it: a request without them samples differently
        logger.warning("requests' default sampling is the model's generation config (%s); "
                       "--generation-config vllm turns it off", sampling_defaults.describe())
    config = load_hf_config(model_dir)
    tokenizer = load_prompt_tokenizer(model_dir)
    if chat_template is not None:
        tokenizer = copy.copy(tokenizer)  # common.text.tokenizer's are shared per directory
        tokenizer.chat_template = read_chat_template(chat_template)
    if default_chat_template_kwargs is not None:
        ChatTemplateOptions(chat_template_kwargs=default_chat_template_kwargs)  # the same checks a request's get
    warm_chat_template(tokenizer)
    served_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    name = (served_names or [None])[0] or model or BUNDLED_MODEL_NAME
    aliases = {name, *served_names, model or BUNDLED_MODEL_NAME, str(model_dir), model_dir.name}
    if model in (None, "", "bundled", BUNDLED_MODEL_NAME):
        aliases |= {"bundled", BUNDLED_MODEL_NAME}
    return ServedModel(name=name, aliases=frozenset(aliases), model_dir=model_dir, tokenizer=tokenizer,
                       other_served_names=tuple(n for n in dict.fromkeys(served_names) if n != name),
                       max_position_embeddings=config.get("max_position_embeddings", 2048),
                       vocab_size=config.get("vocab_size") or tokenizer.vocab_size,
                       default_chat_template_kwargs=default_chat_template_kwargs or None,
                       trust_request_chat_template=trust_request_chat_template,
                       sampling_defaults=sampling_defaults)


def warm_chat_template(tokenizer) -> None:
    """Render the chat template once, at start-up: the first render imports transformers'
    renderer and compiles the template (half a second on the Zen 5), which the first chat
    request would otherwise wait for. A template that refuses this one message is compiled
    all the same, and a start-up never fails here: requests get the template's errors."""
    if getattr(tokenizer, "chat_template", None) is None:
        return
    try:
        tokenizer.render_chat_template([{"role": "user", "content": "hi"}])
    except Exception:  # noqa: BLE001 -- only a head start; each request renders and reports its own
        logger.debug("the chat template refused the start-up render", exc_info=True)


def read_chat_template(value: str) -> str:
    """--chat-template's value: a file's path, else the template itself (vLLM takes both)."""
    path = Path(value).expanduser()
    try:
        is_file = "{" not in value and path.is_file()
    except OSError:  # a template too long to be a path
        is_file = False
    if is_file:
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def prompt_chars(request: GenerateInput | EmbedInput) -> int:
    """What the tokenizer reads: the text, or the messages' content, tool calls' arguments,
    the tools the template lists and its extra variables."""
    if request.text is not None:
        return len(request.text)
    num_chars = request.chat_options.num_extra_chars if request.messages is not None else 0
    for message in request.messages or ():
        num_chars += len(str(message.get("content", "")))
        for call in message.get("tool_calls") or ():
            num_chars += len(str(call.get("function", {}).get("arguments", "")))
    return num_chars


def _check_model_and_id(request: GenerateInput | EmbedInput, model: ServedModel, served_names: frozenset[str],
                        lora_names: frozenset[str]) -> str | None:
    """The LoRA adapter the request's model names (None: the base model); INVALID_ARGUMENT
    for a model not served here, a request id too long or a cache_salt out of bounds."""
    if request.model and request.model not in model.aliases | served_names | lora_names:
        adapters = f", and LoRA adapters {', '.join(sorted(lora_names))}" if lora_names else ""
        raise invalid(f"model {request.model!r} is not served here; this gateway serves "
                      f"{model.name!r} (leave model empty for it){adapters}")
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id has {len(request.request_id)} characters; at most "
                      f"{MAX_REQUEST_ID_CHARS} are allowed")
    if request.cache_salt is not None:
        try:
            check_cache_salt(request.cache_salt)
        except ValueError as e:
            raise invalid(str(e)) from None
    is_base = request.model in model.aliases | served_names
    return request.model if request.model and not is_base else None


def prepare_request(request: GenerateInput, model: ServedModel, max_model_len: int, max_prompt_chars: int,
                    served_names: frozenset[str] = frozenset(),
                    lora_names: frozenset[str] = frozenset()) -> PreparedRequest:
    """Validate and tokenize; raise ServiceError(INVALID_ARGUMENT) naming the problem."""
    lora_name = _check_model_and_id(request, model, served_names, lora_names)
    sampling = request.sampling
    if sampling.n != 1:
        # GenerateResponse holds one completion, so n > 1 has nowhere to go.
        raise invalid(f"sampling.n={sampling.n} is not supported: send n separate requests "
                      f"(with seeds seed+i for reproducible samples)")
    prompt_token_ids = tokenize_prompt(request, model, max_prompt_chars)
    try:
        prompt_token_ids = truncate_prompt(prompt_token_ids, sampling.truncate_prompt_tokens, max_model_len)
        sampling = with_bad_words_token_ids(
            sampling, lambda word: model.tokenizer.encode(word, add_special_tokens=False))
    except ValueError as e:
        raise invalid(f"sampling.{e}") from None
    num_prompt = len(prompt_token_ids)
    if num_prompt >= max_model_len:
        raise invalid(f"prompt has {num_prompt} tokens, but the model accepts at most {max_model_len} "
                      f"tokens of prompt and completion together; shorten the prompt")
    if sampling.max_tokens is not None and num_prompt + sampling.max_tokens > max_model_len:
        raise invalid(f"prompt ({num_prompt} tokens) plus max_tokens ({sampling.max_tokens}) exceeds "
                      f"the model's maximum length of {max_model_len} tokens; set max_tokens to at "
                      f"most {max_model_len - num_prompt}")
    try:
        sampling.validate_token_ids(model.vocab_size)
        if request.return_logprobs and sampling.logprobs is None:
            sampling = sampling.clone(logprobs=0)  # the sampled token's logprob only
    except ValueError as e:
        raise invalid(f"sampling.{e}") from None
    return PreparedRequest(request_id=request.request_id or uuid.uuid4().hex,
                           prompt_token_ids=prompt_token_ids, sampling=sampling,
                           priority=request.priority, return_token_ids=request.return_token_ids,
                           cache_salt=request.cache_salt, lora_name=lora_name)


def prepare_embedding(request: EmbedInput, model: ServedModel, max_model_len: int, max_prompt_chars: int,
                      served_names: frozenset[str] = frozenset(),
                      lora_names: frozenset[str] = frozenset()) -> PreparedEmbedding:
    """Validate and tokenize an Embed call; raise ServiceError(INVALID_ARGUMENT) naming the
    problem. A prompt may take the whole max_model_len: nothing is generated after it."""
    lora_name = _check_model_and_id(request, model, served_names, lora_names)
    keep = request.truncate_prompt_tokens
    if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or (keep < 1 and keep != -1)):
        raise invalid(f"truncate_prompt_tokens must be -1 (the model's maximum length) or an integer >= 1, "
                      f"got {keep!r}")
    prompt_token_ids = tokenize_prompt(request, model, max_prompt_chars)
    try:
        prompt_token_ids = truncate_prompt(prompt_token_ids, keep, max_model_len)
    except ValueError as e:
        raise invalid(str(e)) from None
    if len(prompt_token_ids) > max_model_len:
        raise invalid(f"prompt has {len(prompt_token_ids)} tokens, more than the model's maximum length of "
                      f"{max_model_len}; shorten it or set truncate_prompt_tokens")
    return PreparedEmbedding(request_id=request.request_id or uuid.uuid4().hex,
                             prompt_token_ids=prompt_token_ids, pooling=request.pooling, priority=request.priority,
                             cache_salt=request.cache_salt, lora_name=lora_name)


def _with_defaults(options: ChatTemplateOptions, model: ServedModel) -> ChatTemplateOptions:
    """The request's template variables over the server's defaults."""
    if not model.default_chat_template_kwargs:
        return options
    return dataclasses.replace(options, chat_template_kwargs={**model.default_chat_template_kwargs,
                                                              **(options.chat_template_kwargs or {})})


def tokenize_prompt(request: GenerateInput | EmbedInput, model: ServedModel, max_prompt_chars: int) -> list[int]:
    """The prompt's token ids, each in the vocabulary; INVALID_ARGUMENT for a prompt past the
    bounds or one the tokenizer refuses."""
    forms = [name for name in ("text", "token_ids", "messages") if getattr(request, name) is not None]
    if not forms:
        raise invalid("the prompt is missing: set text, token_ids or messages")
    if len(forms) > 1:  # only possible from Python; the proto has a oneof
        raise invalid(f"set exactly one prompt form, got {' and '.join(forms)}")
    if request.messages is not None and len(request.messages) > MAX_CHAT_MESSAGES:
        raise invalid(f"messages: {len(request.messages)} messages, more than the limit of {MAX_CHAT_MESSAGES}")
    num_chars = prompt_chars(request)
    if num_chars > max_prompt_chars:
        raise invalid(f"the prompt has {num_chars} characters, more than this gateway's limit of "
                      f"{max_prompt_chars} (--max-prompt-chars)")
    try:
        if request.text is not None:
            if not request.text:
                raise ValueError("the prompt text is empty")
            token_ids = model.tokenizer.encode(request.text,
                                               add_special_tokens=request.add_special_tokens is not False)
        elif request.messages is not None:
            if request.chat_options.chat_template is not None and not model.trust_request_chat_template:
                raise ValueError("chat_template: a template was sent with the request, but this gateway does not "
                                 "run request templates (start it with --trust-request-chat-template)")
            options = _with_defaults(request.chat_options, model)
            token_ids = model.tokenizer.apply_chat_template(request.messages, options,
                                                            add_special_tokens=bool(request.add_special_tokens))
        else:
            token_ids = request.token_ids
        validate_prompt_token_ids(token_ids, model.vocab_size)
    except ValueError as e:
        raise invalid(str(e)) from None
    return token_ids
