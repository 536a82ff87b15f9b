"""The structured-output manager: lives beside the scheduler in the engine core.

At admission it gives each constrained request its own grammar (compiling the
constraint, or finding it cached) before the scheduler sees the request, so a bad
constraint fails before any KV is allocated. Each step it fills the token bitmask
of the constrained rows that sample (a grammar held back until the output writes its
start_after_token_ids constrains nothing until then); the scheduler advances a request's grammar
with every token it accepts and finishes the request once the grammar is done.

Preemption needs nothing here: in recompute mode a request keeps its output
tokens, and its grammar has accepted exactly those, so its state stays right.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.engine.outputs import SchedulerOutput
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams
from common.engine.structured_output.compile_buckets import COMPILE_SECONDS_BUCKETS
from common.text.tokenizer import load_eos_token_ids

if TYPE_CHECKING:  # xgrammar (and the transformers it imports) only once a constraint comes
    from common.engine.structured_output.backend import XgrammarBackend

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.num_constrained_requests = 0
        self.num_bitmask_steps = 0
        self.bitmask_seconds_total = 0.0

    @property
    def backend(self) -> XgrammarBackend:
        """Built on first use (or by warm_up_in_background): importing xgrammar and reading
        the vocabulary take most of a second of one core."""
        with self._backend_lock:
            if self._backend is None:
                from common.engine.structured_output.backend import XgrammarBackend
                eos = tuple(dict.fromkeys(load_eos_token_ids(self._model_dir) + self._eos_token_ids))
                self._backend = XgrammarBackend(self._model_dir, self._vocab_size, eos)
            return self._backend

    def warm_up_in_background(self) -> threading.Thread:
        """Build the backend and compile once on a daemon thread, so that the first
        constrained requests do not wait for it (vLLM's engines pay this at start-up, where
        they load the tokenizer). A request that comes first waits on the same lock; a
        failure is logged, and the first request tries again and answers with the error."""
        def warm_up() -> None:
            try:
                self.backend.warm_up()
            except Exception:  # noqa: BLE001 -- only a head start: requests build it again
                logger.warning("structured outputs: warming up the grammar backend failed", exc_info=True)

        thread = threading.Thread(target=warm_up, name="structured-output-warm-up", daemon=True)
        thread.start()
        return thread

    @property
    def is_warm(self) -> bool:
        """The backend is built."""
        return self._backend is not None

    def compile(self, params: SamplingParams) -> None:
        """Compile (and cache) params' constraint; thread-safe, for callers off the
        engine loop. ValueError naming the field when the constraint is rejected."""
        if params.structured_outputs is not None:
            self.backend.compile(params.structured_outputs)

    def prepare(self, request: Request) -> None:
        """A fresh grammar for the request, advanced over any output it already has."""
        constraint = request.sampling_params.structured_outputs
        if constraint is None:
            request.grammar = None
            return
        grammar = self.backend.new_grammar(constraint)
        if request.output_token_ids and not grammar.replay(request.output_token_ids):
            raise ValueError("the request's output so far does not match its structured_outputs")
        request.grammar = grammar
        self.num_constrained_requests += 1

    def fill_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Set scheduler_output's bitmask for the constrained requests that sample this step."""
        constrained = [r.req_id for r in scheduler_output.scheduled
                       if r.do_sample and _active_grammar(requests.get(r.req_id))]
        if not constrained:
            return
        import xgrammar as xgr  # constrained rows: the backend imported it already
        started = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(len(constrained), self._vocab_size)  # [rows, words] int32
        for row, req_id in enumerate(constrained):
            requests[req_id].grammar.fill_bitmask(bitmask, row)
        scheduler_output.grammar_bitmask = bitmask
        scheduler_output.structured_output_req_ids = constrained
        self.num_bitmask_steps += 1
        self.bitmask_seconds_total += time.perf_counter() - started

    def stats(self) -> dict[str, float | list[int]]:
        backend = self._backend
        return {"structured_output_requests": self.num_constrained_requests,
                "structured_output_compiles": backend.num_compiles if backend else 0,
                "structured_output_compile_seconds": backend.compile_seconds_total if backend else 0.0,
                "structured_output_compile_bucket_counts": (list(backend.compile_bucket_counts) if backend
                                                            else [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)),
                "structured_output_bitmask_steps": self.num_bitmask_steps,
                "structured_output_bitmask_seconds": self.bitmask_seconds_total}


def _active_grammar(request: Request | None) -> bool:
    grammar = getattr(request, "grammar", None)
    return grammar is not None and grammar.is_active
