"""How a chat conversation becomes a prompt: the options a request may set on the model's
chat template (vLLM's chat request fields of the same names), checked once here for every
way in (HTTP, gRPC, the offline LLM)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# At most this many extra template variables a request: templates read a handful
# (enable_thinking, a date, a persona); the bound keeps a request from handing the
# renderer an arbitrarily wide namespace.
MAX_CHAT_TEMPLATE_KWARGS = 64
# OpenAI's own limit on the tools one request may list.
MAX_TOOLS = 128
MAX_DOCUMENTS = 128
# A request's own template (where the server trusts them): a model's runs to ~10 KB.
MAX_CHAT_TEMPLATE_CHARS = 64 * 1024
# Variables the renderer sets itself: a request's kwargs may not replace them, or a
# conversation could be swapped for another after the gateway counted and checked it.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "chat_template", "tokenize", "return_dict", "return_assistant_tokens_mask",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})


@dataclass(frozen=True)
class ChatTemplateOptions:
    # End with the assistant's header, so that the model answers as the assistant.
    add_generation_prompt: bool = True
    # Leave the last message open (no end-of-turn marker) so that the model continues it:
    # an answer prefilled by the caller. Exclusive with add_generation_prompt.
    continue_final_message: bool = False
    # Extra variables the template reads (e.g. {"enable_thinking": False}).
    chat_template_kwargs: dict[str, Any] | None = None
    # The functions the model may call, as the template lists them: OpenAI's
    # [{"type": "function", "function": {"name", "description", "parameters"}}].
    tools: list[dict[str, Any]] | None = None
    # Documents for retrieval-augmented templates (Command R, Granite ...): [{"title", "text"}].
    documents: list[dict[str, str]] | None = None
    # A Jinja template for this request instead of the model's (vLLM's chat_template), rendered
    # in the same sandbox; the gateway takes it only with --trust-request-chat-template.
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template
                                               or len(self.chat_template) > MAX_CHAT_TEMPLATE_CHARS):
            raise ValueError(f"chat_template: must be a non-empty string of at most {MAX_CHAT_TEMPLATE_CHARS} "
                             f"characters")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be true while add_generation_prompt is true "
                             "(the default); set add_generation_prompt to false to continue the last message")
        if self.tools is not None:
            if not isinstance(self.tools, list) or not all(isinstance(tool, dict) for tool in self.tools):
                raise ValueError("tools: must be a list of objects")
            if len(self.tools) > MAX_TOOLS:
                raise ValueError(f"tools: {len(self.tools)} tools, more than the limit of {MAX_TOOLS}")
        if self.documents is not None and (
                not isinstance(self.documents, list) or len(self.documents) > MAX_DOCUMENTS
                or not all(isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
                           for d in self.documents)):
            raise ValueError(f"documents: must be a list of at most {MAX_DOCUMENTS} objects of strings, "
                             f"e.g. {{\"title\": ..., \"text\": ...}}")
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            return
        if not isinstance(kwargs, dict):
            raise ValueError(f"chat_template_kwargs: must be an object, got {type(kwargs).__name__}")
        if len(kwargs) > MAX_CHAT_TEMPLATE_KWARGS:
            raise ValueError(f"chat_template_kwargs: {len(kwargs)} variables, more than the limit of "
                             f"{MAX_CHAT_TEMPLATE_KWARGS}")
        for name in kwargs:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
            if name in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"chat_template_kwargs.{name}: is set by the server, not by a request"
                                 + (f"; use the request's {name} field" if name in (
                                     "add_generation_prompt", "continue_final_message") else ""))

    @cached_property
    def num_extra_chars(self) -> int:
        """The tools', documents' and template variables' JSON length and a request's own
        template: the template may render them into the prompt, so they count toward its bound."""
        return len(self.chat_template or "") + sum(
            len(json.dumps(value)) for value in (self.tools, self.documents, self.chat_template_kwargs) if value)

    def render_kwargs(self) -> dict[str, Any]:
        """What the renderer passes the template besides the messages."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "tools": self.tools or None,
                "documents": self.documents or None,
                **(self.chat_template_kwargs or {})}


DEFAULT_CHAT_TEMPLATE_OPTIONS = ChatTemplateOptions()
