"""Token ids -> text deltas, one request at a time, with stop strings (vLLM semantics).

Decoding streams through tokenizers' DecodeStream (Rust): it decodes a small sliding
window of ids, emits text only once it does not end in U+FFFD (an incomplete UTF-8
character, e.g. an emoji split over byte-level or <0xE2>-style tokens) and keeps
the leading space a token gets after the previous one. It is primed with the end
of the prompt so the first output token is decoded in context.

A stop token (the token that stopped the request: EOS, a stop token id, a constraint's end)
is fed with `stopped=True`: its text is left out unless include_stop_str_in_output, as in
vLLM (shown_token_ids; it stays among the output's ids).

Stop strings: a match may span tokens; the text is cut before it (after it with
include_stop_str_in_output) and nothing later is returned. Without
include_stop_str_in_output, the longest tail of the text that is the start of some
stop string (at most max(len(stop)) - 1 chars) is held back until the next tokens
show whether the stop string completes; flush() returns it at the end.
"""
from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

from common.text.tokenizer import Tokenizer

# Prompt tokens used as decoding context: enough for the first output token's
# leading space and merges, few enough that priming costs nothing (vLLM uses 5).
_NUM_CONTEXT_IDS = 5


def shown_token_ids(token_ids: Sequence[int], stopped: bool, include_stop_str_in_output: bool) -> Sequence[int]:
    """The ids whose text the output shows: where the last one stopped the request, all but
    it, unless include_stop_str_in_output (vLLM's rule)."""
    return token_ids[:-1] if stopped and token_ids and not include_stop_str_in_output else token_ids


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False):
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        # A held-back tail must end with one of these (the chars of some stop[:-1]):
        # checking the last char first skips the search for almost every token.
        self._stop_prefix_chars = set("".join(s[:-1] for s in self._stop))

        self._context_ids = _clean_context(self._backend, list(prompt_token_ids[-24:]),
                                           skip_special_tokens)
        self._stream = DecodeStream(ids=self._context_ids or None,
                                    skip_special_tokens=skip_special_tokens)
        # Ids the stream holds without having emitted their text (an incomplete char).
        self._pending_ids: list[int] = []

        self._returned: list[str] = []  # every delta returned so far
        self._returned_tail = ""  # include_stop_str_in_output: last max_stop_len-1 returned chars
        self._held = ""  # decoded but not yet returned (a possible stop-string start)
        self.stop_string: str | None = None  # the stop string that matched
        self.finished = False  # True once a stop string matched

    @property
    def output_text(self) -> str:
        """All text decoded so far (returned and held back), cut at the stop string."""
        return "".join(self._returned) + self._held

    def update(self, new_token_ids: Sequence[int], stopped: bool = False) -> str:
        """Feed the request's new token ids; return the text delta to send (maybe "").
        stopped: the last of them stopped the request (shown_token_ids)."""
        new_token_ids = shown_token_ids(new_token_ids, stopped, self._include_stop)
        if self.finished or not new_token_ids:
            return ""
        pieces = []
        for token_id in new_token_ids:
            piece = self._step(token_id)
            if piece is None:
                self._pending_ids.append(token_id)
            else:
                self._context_ids = (self._context_ids + self._pending_ids + [token_id])[
                    -_NUM_CONTEXT_IDS:]
                self._pending_ids = []
                pieces.append(piece)
        return self._accept("".join(pieces), final=False)

    def flush(self) -> str:
        """At the end of the request: the held-back text, plus any incomplete character
        (decoded with U+FFFD, exactly as tokenizer.decode would)."""
        if self.finished:
            return ""
        text = ""
        if self._pending_ids:
            context = self._decode(self._context_ids)
            text = self._decode(self._context_ids + self._pending_ids)[len(context):]
            self._pending_ids = []
        return self._accept(text, final=True)

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:
            # DecodeStream raises when its window's text no longer starts with what it
            # emitted (rare merges); restart from this token, as vLLM does.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            return self._stream.step(self._backend, self._pending_ids + [token_id])

    def _decode(self, token_ids: list[int]) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _accept(self, new_text: str, final: bool) -> str:
        """Run the stop-string check on new_text; return what may be sent now."""
        if not self._stop:
            self._returned.append(new_text)
            return new_text
        # A match must end inside new_text, and (thanks to hold-back) start inside
        # held + new_text; with include_stop_str_in_output nothing is held, so the
        # match may start in the returned tail.
        window = self._returned_tail + self._held + new_text
        num_sent = len(self._returned_tail)  # chars of window already returned
        if new_text:
            match = _find_first_stop(window, self._stop, len(window) - len(new_text))
            if match is not None:
                stop_start, stop_string = match
                end = stop_start + len(stop_string) if self._include_stop else stop_start
                delta = window[num_sent:end]
                self._returned.append(delta)
                self._held = ""
                self.stop_string, self.finished = stop_string, True
                return delta
        unsent = window[num_sent:]
        num_hold = 0 if (final or self._include_stop) else self._num_to_hold(unsent)
        delta, self._held = unsent[:len(unsent) - num_hold], unsent[len(unsent) - num_hold:]
        self._returned.append(delta)
        if self._include_stop and self._max_stop_len > 1:
            self._returned_tail = (self._returned_tail + delta)[-(self._max_stop_len - 1):]
        return delta

    def _num_to_hold(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        if not text or text[-1] not in self._stop_prefix_chars:
            return 0
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def _find_first_stop(text: str, stops: list[str], new_start: int) -> tuple[int, str] | None:
    """Earliest stop string in text that ends at or after new_start (list order breaks ties)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, new_start - len(stop) + 1))
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _clean_context(backend, prompt_token_ids: list[int], skip_special_tokens: bool) -> list[int]:
    # The context must decode to whole characters: one that starts or ends inside a
    # multi-byte character would make the stream emit or expect U+FFFD. Grow the
    # prompt suffix until it is clean (vLLM does the same); none clean: no context.
    for num_ids in range(min(_NUM_CONTEXT_IDS, len(prompt_token_ids)),
                         min(24, len(prompt_token_ids)) + 1):
        suffix = prompt_token_ids[len(prompt_token_ids) - num_ids:]
        if "\ufffd" not in backend.decode(suffix, skip_special_tokens=skip_special_tokens):
            return suffix
    return []
