"""A thin wrapper over a Hugging Face fast tokenizer, loaded from local files only.

encode/decode go straight to the Rust `tokenizers.Tokenizer` (the same one the
incremental detokenizer streams through, so both decode identically); the
transformers object is kept for the chat template. Loaded tokenizers are cached
per directory: the gateway and every engine in a process share one.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import jinja2

from common.text.chat_template import DEFAULT_CHAT_TEMPLATE_OPTIONS, ChatTemplateOptions

CHAT_ROLES = ("system", "user", "assistant", "tool")

_cache: dict[str, "Tokenizer"] = {}
_cache_lock = threading.Lock()


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, model_dir: Path):
        self.hf_tokenizer = hf_tokenizer  # transformers' fast tokenizer
        self.backend = hf_tokenizer.backend_tokenizer  # tokenizers.Tokenizer (Rust)
        self.chat_template: str | None = None  # a template used instead of the model's; None: its own
        self.model_dir = model_dir
        # Tokens the tokenizer knows, added tokens included. The model's embedding
        # (and so the logits) may be wider, padded for efficiency: model_vocab_size.
        self.vocab_size: int = len(hf_tokenizer)
        config = read_json_file(model_dir / "config.json")
        self.model_vocab_size: int = config.get("vocab_size") or self.vocab_size
        self.eos_token_ids: tuple[int, ...] = merged_eos_token_ids(hf_tokenizer.eos_token_id, config, model_dir)
        # transformers' special ids plus every added token flagged special: exactly
        # what decode(skip_special_tokens=True) drops.
        added_special = [i for i, t in self.backend.get_added_tokens_decoder().items() if t.special]
        self.all_special_ids: list[int] = sorted(
            set(hf_tokenizer.all_special_ids) | set(added_special))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: list[dict],
                             options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS) -> str:
        """The chat template's text for `messages` (OpenAI-style role/content dicts)."""
        messages = check_messages(messages)
        try:
            return self.hf_tokenizer.apply_chat_template(
                messages, tokenize=False, chat_template=options.chat_template or self.chat_template,
                **options.render_kwargs())
        except (jinja2.TemplateError, ValueError) as e:
            # Templates raise for e.g. roles out of order; that is the caller's input.
            raise ValueError(f"chat template rejected the messages: {e}") from e

    def apply_chat_template(self, messages: list[dict], options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS,
                            add_special_tokens: bool = False) -> list[int]:
        # The template writes BOS/role markers itself, so by default no special tokens are
        # added (what transformers does when it tokenizes a chat).
        return self.encode(self.render_chat_template(messages, options), add_special_tokens=add_special_tokens)


def check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        if "role" not in message or "content" not in message:
            missing = [k for k in ("role", "content") if k not in message]
            raise ValueError(f"messages[{i}] is missing {' and '.join(map(repr, missing))}")
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {list(CHAT_ROLES)}, "
                             f"got {role!r}")
        if isinstance(content, list):
            # OpenAI content parts: text parts are joined with newlines, like vLLM does
            # for templates that take a plain string.
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ValueError(f"messages[{i}]['content']: only text parts "
                                 f"({{'type': 'text', 'text': str}}) are supported")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of text "
                             f"parts, got {type(content).__name__}")
        checked.append({**message, "content": content})
        if message.get("tool_calls"):
            checked[-1]["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
    return checked


def _with_parsed_arguments(call: dict) -> dict:
    """A tool call with its arguments as an object where they are JSON text: what templates
    that write `arguments | tojson` expect (vLLM hands them over the same way)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def read_json_file(path: Path) -> dict:
    """A JSON file's object, or {} when the file is absent."""
    return json.loads(path.read_text()) if path.is_file() else {}


def merged_eos_token_ids(tokenizer_eos_token_id: int | None, config: dict, model_dir: Path) -> tuple[int, ...]:
    """The tokenizer's EOS first, then any the model's config.json or generation_config.json
    add (vLLM merges them too)."""
    ids: list[int] = []
    sources = [tokenizer_eos_token_id, config.get("eos_token_id"),
               read_json_file(model_dir / "generation_config.json").get("eos_token_id")]
    for source in sources:
        for token_id in source if isinstance(source, list) else [source]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)


def load_tokenizer(model_dir: str | os.PathLike) -> Tokenizer:
    """Load (once per directory) the tokenizer in a local Hugging Face directory."""
    model_dir = Path(model_dir).expanduser().resolve()
    key = str(model_dir)
    with _cache_lock:  # also keeps two threads from loading the same one twice
        tokenizer = _cache.get(key)
        if tokenizer is None:
            if not model_dir.is_dir():
                raise ValueError(f"no tokenizer: {model_dir} is not a directory "
                                 f"(nothing is downloaded)")
            from transformers import AutoTokenizer  # slow import; only when needed
            hf_tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            if not getattr(hf_tokenizer, "is_fast", False):
                raise ValueError(f"{model_dir}: a fast (tokenizer.json) tokenizer is required")
            tokenizer = _cache[key] = Tokenizer(hf_tokenizer, model_dir)
    return tokenizer


def load_vocabulary_tokenizer(model_dir: str | os.PathLike) -> Any:
    """A transformers fast tokenizer of the directory, for what reads only its vocabulary and
    decoder (the grammar backend): load_tokenizer's where that is loaded already, else
    PreTrainedTokenizerFast over tokenizer.json and tokenizer_config.json. That skips
    AutoTokenizer's model config, whose class imports transformers' model stack: over a
    second of an engine service's time, against a fifth of one."""
    model_dir = Path(model_dir).expanduser().resolve()
    with _cache_lock:
        loaded = _cache.get(str(model_dir))
    if loaded is not None:
        return loaded.hf_tokenizer
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer: {model_dir} has no tokenizer.json (nothing is downloaded)")
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)


def load_eos_token_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """load_tokenizer(model_dir).eos_token_ids, read from tokenizer.json and the
    tokenizer_config.json eos_token where those settle it (as transformers resolves it:
    the token's id in the vocabulary), else from load_tokenizer. An engine service needs
    only these ids, and transformers' AutoTokenizer, with the model's config class and
    torch._dynamo it imports, costs seconds of the service's start-up."""
    model_dir = Path(model_dir).expanduser().resolve()
    with _cache_lock:
        tokenizer = _cache.get(str(model_dir))
    if tokenizer is not None:
        return tokenizer.eos_token_ids
    eos = read_json_file(model_dir / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    # special_tokens_map.json may name other special tokens: transformers then decides.
    if isinstance(eos, str) and (model_dir / "tokenizer.json").is_file() \
            and not (model_dir / "special_tokens_map.json").exists():
        from tokenizers import Tokenizer as RustTokenizer
        eos_id = RustTokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(eos)
        if eos_id is not None:
            return merged_eos_token_ids(eos_id, read_json_file(model_dir / "config.json"), model_dir)
    return load_tokenizer(model_dir).eos_token_ids
