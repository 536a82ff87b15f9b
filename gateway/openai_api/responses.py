"""GenerationDeltas -> OpenAI response JSON: whole responses, stream chunks, usage, logprobs.

One ResponseBuilder per HTTP request. It keeps what a response needs across
chunks: each choice's completion tokens and logprob text offset, each prompt's
token counts. Usage counts every prompt once, however many choices it has (as
OpenAI does for n > 1); its cached tokens are those of the prompt's first choice.

A completion with `echo` starts with its prompt's text, and with logprobs its prompt's
tokens come first in them (the first with no logprob, as OpenAI's legacy API and vLLM
give them); a chat answer with `echo` starts with the last message's content when that
message has the answer's role (vLLM's). A chat answer's reasoning, tool calls and content
are chat_answer.py's. `prompt_logprobs` (vLLM's) are vLLM's shape: per prompt token None
(the first) or {token id: {logprob, rank, decoded_token}} for the token and the top
alternatives.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from common.engine.outputs import Logprobs
from gateway.openai_api.chat_answer import ChatAnswer
from gateway.openai_api.errors import ApiError
from gateway.openai_api.protocol import ParsedRequest
from gateway.openai_api.reasoning_parsers import ReasoningParser
from gateway.types import GenerationDelta

MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM clamps the same way)


def sse_event(payload: dict) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def json_bytes(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


class ResponseBuilder:
    def __init__(self, request: ParsedRequest, response_id: str, model_name: str,
                 token_text: Callable[[int], str], echo_prompts: list[tuple[str, list[int]]] | None = None,
                 reasoning_parser: ReasoningParser | None = None):
        self.request = request
        self.chat = request.chat
        self.head = {"id": response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": model_name}
        self.token_text = token_text
        # How a token is named in logprobs: its text, or vLLM's "token_id:<id>" on request
        # (a token that is part of a multi-byte character has no text of its own).
        self.logprob_token = _token_id_name if request.return_tokens_as_token_ids else token_text
        num_choices = request.num_prompts * request.sampling.n
        self.completion_tokens = [0] * num_choices
        self.text_offsets = [0] * num_choices  # completions logprobs: offset of the next token
        self.prompt_tokens = [0] * request.num_prompts
        self.cached_tokens = [0] * request.num_prompts
        self.started = [False] * num_choices  # the role (chat), an echo, prompt logprobs: in the first chunk
        self.echo_prompts = echo_prompts  # per prompt (text, token ids), for request.echo
        # Chat: each choice's text -> its message (reasoning, tool calls, content)
        self.answers = [ChatAnswer(request, reasoning_parser) for _ in range(num_choices)] if self.chat else []

    def _record(self, index: int, delta: GenerationDelta) -> None:
        self.completion_tokens[index] = delta.usage.completion_tokens
        prompt, sample = divmod(index, self.request.sampling.n)
        self.prompt_tokens[prompt] = delta.usage.prompt_tokens
        if sample == 0:
            self.cached_tokens[prompt] = delta.usage.cached_prompt_tokens

    def usage(self) -> dict:
        prompt_tokens, completion_tokens = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    # --- non-streaming ---------------------------------------------------------------

    def full_response(self, results: list[GenerationDelta]) -> dict:
        """The response to a non-streaming request: one joined delta per choice, in order."""
        choices = []
        for index, result in enumerate(results):
            self._record(index, result)
            choice = {"index": index, "logprobs": self._logprobs(index, result, first=True),
                      "finish_reason": result.finish_reason, "stop_reason": _stop_reason(result)}
            if self.request.return_token_ids:
                if not self.chat:
                    choice["prompt_token_ids"] = result.prompt_token_ids
                choice["token_ids"] = result.token_ids
            if self.chat:
                choice["message"] = self.answers[index].message(result.text)
                if self.answers[index].made_calls:
                    choice["finish_reason"] = "tool_calls"
            else:
                choice["text"] = self._echoed_text(index) + result.text
                if self.request.sampling.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(result)
            choices.append(choice)
        response = {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                    "choices": choices, "usage": self.usage()}
        if self.chat and self.request.sampling.prompt_logprobs is not None and results:
            response["prompt_logprobs"] = self._prompt_logprobs(results[0])  # every choice's prompt
        if self.chat and self.request.return_token_ids and results:
            response["prompt_token_ids"] = results[0].prompt_token_ids
        return response

    # --- streaming -------------------------------------------------------------------

    def chunk(self, index: int, delta: GenerationDelta) -> bytes:
        """The SSE event for one delta of choice `index`."""
        return sse_event(self.chunk_payload(index, delta))

    def chunk_payload(self, index: int, delta: GenerationDelta) -> dict:
        """The chat chunk (or completion chunk) for one delta of choice `index`."""
        self._record(index, delta)
        choice: dict = {"index": index}
        first, self.started[index] = not self.started[index], True
        if self.chat:
            choice["delta"] = self.answers[index].delta(delta.text, delta.finish_reason is not None, first)
        else:
            choice["text"] = (self._echoed_text(index) if first else "") + delta.text
        choice["logprobs"] = self._logprobs(index, delta, first)
        if first and self.request.sampling.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(delta)
        choice["finish_reason"] = delta.finish_reason
        if self.request.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if first and not self.chat:
                choice["prompt_token_ids"] = delta.prompt_token_ids
        if self.chat and delta.finish_reason is not None and self.answers[index].made_calls:
            choice["finish_reason"] = "tool_calls"
        if delta.finish_reason is not None:
            choice["stop_reason"] = _stop_reason(delta)
        payload = {**self.head, "choices": [choice]}
        if self.chat and first and self.request.return_token_ids:  # vLLM's place for them in chat
            payload["prompt_token_ids"] = delta.prompt_token_ids
        if self.request.continuous_usage:
            payload["usage"] = self.usage()
        elif self.request.include_usage:
            payload["usage"] = None  # OpenAI: every chunk but the last has "usage": null
        return payload

    def usage_chunk(self) -> bytes:
        """stream_options.include_usage: the last chunk, no choices, the whole usage."""
        return sse_event({**self.head, "choices": [], "usage": self.usage()})

    def ending(self, error: ApiError | None) -> bytes:
        """The stream's last bytes: the error event of a failure after it began, or the
        usage chunk where asked; then [DONE]."""
        if error is not None:
            return error_event(error) + SSE_DONE
        return (self.usage_chunk() if self.request.include_usage else b"") + SSE_DONE

    # --- logprobs --------------------------------------------------------------------

    def _echoed_text(self, index: int) -> str:
        return "" if self.echo_prompts is None else self.echo_prompts[index // self.request.sampling.n][0]

    def _logprobs(self, index: int, delta: GenerationDelta, first: bool) -> dict | None:
        if self.request.num_logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(token_id, lp) for token_id, lp in delta.logprobs]}
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        if first and self.echo_prompts is not None:  # the prompt's tokens first, the first with none
            prompt_token_ids = self.echo_prompts[index // self.request.sampling.n][1]
            computed = dict(enumerate(lp for _, lp in delta.prompt_logprobs))  # position - 1 -> Logprobs
            for position, token_id in enumerate(prompt_token_ids):
                shown = self.logprob_token(token_id)
                lp = computed.get(position - 1)
                tokens.append(shown)
                token_logprobs.append(None if lp is None else _clamp(lp.token_logprob))
                top_logprobs.append(None if lp is None else self._top(shown, lp))
                offsets.append(self.text_offsets[index])
                self.text_offsets[index] += len(self.token_text(token_id))
        for token_id, lp in delta.logprobs:
            shown = self.logprob_token(token_id)
            tokens.append(shown)
            token_logprobs.append(_clamp(lp.token_logprob))
            top_logprobs.append(self._top(shown, lp))
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(self.token_text(token_id))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}

    def _top(self, text: str, lp: Logprobs) -> dict:
        """The token and the top alternatives by their text (vLLM's legacy completions shape)."""
        top = {text: _clamp(lp.token_logprob)}
        top.update((self.logprob_token(t), _clamp(v)) for t, v in zip(lp.top_token_ids, lp.top_logprobs))
        return top

    def _prompt_logprobs(self, delta: GenerationDelta) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token its own
        entry (with its rank among all tokens) and its top alternatives' by token id."""
        entries: list[dict | None] = [None]
        for token_id, lp in delta.prompt_logprobs:
            entry = {str(t): {"logprob": _clamp(v), "rank": rank, "decoded_token": self.token_text(t)}
                     for rank, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1)}
            if str(token_id) not in entry:
                entry[str(token_id)] = {"logprob": _clamp(lp.token_logprob), "rank": lp.token_rank,
                                        "decoded_token": self.token_text(token_id)}
            entries.append(entry)
        return entries

    def _chat_logprob(self, token_id: int, lp: Logprobs) -> dict:
        text = self.logprob_token(token_id)
        return {"token": text, "logprob": _clamp(lp.token_logprob), "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self.logprob_token(top_id)), "logprob": _clamp(v),
                                  "bytes": list(t.encode())}
                                 for top_id, v in zip(lp.top_token_ids, lp.top_logprobs)]}


def error_event(error: ApiError) -> bytes:
    """A failure after the stream began (its status line is gone): an error event, as vLLM sends."""
    return sse_event(error.body())


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _stop_reason(delta: GenerationDelta) -> str | int | None:
    """vLLM's extension: the stop string or stop token that ended the choice (None for EOS)."""
    return delta.stop_string if delta.stop_string is not None else delta.stop_token_id


class TokenTexts:
    """Token id -> its text, cached (the vocabulary bounds the cache)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text
