"""The prompt tokenizer of the gateway and the offline LLM: the model's tokenizer.json and
chat template, without torch or AutoTokenizer.

common.text.tokenizer goes through transformers' AutoTokenizer, which imports torch
(~1.5 s and ~300 MB per process) although the gateway never runs the model, and costs
the offline LLM ~1.8 s of its start-up (the engine's structured outputs read only the
vocabulary, through load_vocabulary_tokenizer). This
loads the same Rust `tokenizers.Tokenizer` from tokenizer.json and renders the chat
template with transformers' own `render_jinja_template` (which does not import
torch), passing the special tokens exactly as transformers' apply_chat_template
does, so both produce the same ids (tests/unit/common/text/test_prompt_tokenizer.py checks).
Directories without a tokenizer.json fall back to common.text.tokenizer.

It offers what the gateway, the offline LLM and common.text.detokenizer use of
common.text.tokenizer.Tokenizer: encode, decode, apply_chat_template, backend, vocab_size,
model_vocab_size, eos_token_ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.text.chat_template import DEFAULT_CHAT_TEMPLATE_OPTIONS, ChatTemplateOptions
from common.text.tokenizer import check_messages, load_tokenizer, merged_eos_token_ids, read_json_file

# transformers' SpecialTokensMixin attributes: what templates may read as variables.
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class PromptTokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as RustTokenizer
        self.model_dir = model_dir
        self.backend = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = read_json_file(model_dir / "tokenizer_config.json")
        self._special_tokens = {name: _token_text(config[name]) for name in _SPECIAL_TOKEN_NAMES
                                if config.get(name) is not None}
        self.chat_template: str | None = _chat_template(model_dir, config)
        self.vocab_size: int = self.backend.get_vocab_size(with_added_tokens=True)
        model_config = read_json_file(model_dir / "config.json")
        self.model_vocab_size: int = model_config.get("vocab_size") or self.vocab_size
        eos = self._special_tokens.get("eos_token")
        self.eos_token_ids: tuple[int, ...] = merged_eos_token_ids(
            self.backend.token_to_id(eos) if eos else None, model_config, model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat_template(self, messages: list[dict],
                             options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS) -> str:
        template = options.chat_template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template; send the prompt as text or token ids")
        messages = check_messages(messages)
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], chat_template=template,
                **{**self._special_tokens, **options.render_kwargs()})
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        return rendered[0]

    def apply_chat_template(self, messages: list[dict], options: ChatTemplateOptions = DEFAULT_CHAT_TEMPLATE_OPTIONS,
                            add_special_tokens: bool = False) -> list[int]:
        # The template writes BOS and role markers itself (as common.text.tokenizer does).
        return self.encode(self.render_chat_template(messages, options), add_special_tokens=add_special_tokens)


def _token_text(value: Any) -> str:
    # tokenizer_config.json holds special tokens as strings or AddedToken dicts.
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    # transformers >= 4.43 saves it to chat_template.jinja; older configs inline it,
    # either as one string or as named templates of which "default" is used.
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (model_dir / "chat_template.json").is_file():
        template = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) else None


def load_prompt_tokenizer(model_dir: Path):
    """PromptTokenizer when the directory has a tokenizer.json, else common.text.tokenizer's."""
    if (model_dir / "tokenizer.json").is_file():
        return PromptTokenizer(model_dir)
    return load_tokenizer(model_dir)
