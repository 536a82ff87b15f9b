"""Compiles constraints with xgrammar (vLLM's default backend) and makes matchers.

One backend per engine, built from the model's tokenizer's vocabulary (services build it
while their model loads, anything else on first use). Compiled
grammars are cached by the constraint's text: compiling is the slow part (a
schema can take tens of milliseconds), and it is thread-safe, so services compile
before admission, off the engine loop, and admission finds the grammar cached.
"""
from __future__ import annotations

import bisect
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

import xgrammar as xgr

from common.engine.structured_output.compile_buckets import COMPILE_SECONDS_BUCKETS
from common.engine.structured_output.params import StructuredOutputsParams
from common.engine.structured_output.request_grammar import RequestGrammar
from common.text.tokenizer import load_vocabulary_tokenizer

# Distinct constraints kept compiled; the least recently used goes first.
MAX_CACHED_GRAMMARS = 512
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: ": not for clients.
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class XgrammarBackend:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        # vocab_size is the logits' width (the embedding may be padded past the tokenizer).
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            load_vocabulary_tokenizer(model_dir), vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.compile_seconds_total = 0.0
        # Compiles per COMPILE_SECONDS_BUCKETS bucket (not cumulative), the last one past them all.
        self.compile_bucket_counts = [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar (cached); ValueError naming the field when the backend rejects it."""
        key = params.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        started = time.perf_counter()
        try:
            compiled = self._compile_uncached(params)
        except RuntimeError as e:
            message = _LOG_PREFIX.sub("", str(e).strip())
            raise ValueError(f"structured_outputs.{params.kind} is not supported: {message}") from None
        seconds = time.perf_counter() - started
        with self._lock:
            self.num_compiles += 1
            self.compile_seconds_total += seconds
            self.compile_bucket_counts[bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)] += 1
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile_uncached(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = params.kind
        if kind == "json":
            # Compact JSON: with any whitespace allowed a weak model may pad forever.
            return self._compiler.compile_json_schema(params.json, any_whitespace=False)
        if kind == "json_object":
            # An object, as OpenAI's json_object promises (xgrammar's builtin allows any value).
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(params.regex)
        if kind == "choice":
            return self._compiler.compile_grammar(choice_grammar(params.choice))
        if kind == "structural_tag":
            return self._compiler.compile_structural_tag(params.structural_tag)
        return self._compiler.compile_grammar(params.grammar)

    def warm_up(self) -> None:
        """Compile a small grammar, neither cached nor counted: xgrammar's first compile in a
        process takes a few tens of milliseconds more than the ones after it."""
        self._compiler.compile_builtin_json_grammar()

    def new_grammar(self, params: StructuredOutputsParams) -> RequestGrammar:
        return RequestGrammar(xgr.GrammarMatcher(self.compile(params)), self.vocab_size,
                              params.start_after_token_ids)


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of the strings (as vLLM builds it)."""
    escaped = (re.sub(r'(["\\])', r"\\\1", choice) for choice in choices)
    return "root ::= " + " | ".join(f'"{choice}"' for choice in escaped)
