"""One request's decode messages -> text deltas for the client.

Incremental detokenization with stop strings (common.text.detokenizer), token counts,
and the ids of the instances that served it. Plain Python, no I/O: the dispatcher
feeds it and decides what to do when a delta says the request is over. A request
migrated to another decode instance keeps its assembler: the new instance's tokens
continue the same text, counts and stop-string matching.
"""
from __future__ import annotations

from common.text.detokenizer import IncrementalDetokenizer
from decode_service.api import DecodeOutput
from gateway.types import FINISH_STOP, GenerationDelta, PreparedRequest, Usage


class TextAssembler:
    """One request's decode messages -> deltas: detokenization, stop strings, usage."""

    def __init__(self, tokenizer, request: PreparedRequest, eos_token_ids: frozenset[int]):
        sampling = request.sampling
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, skip_special_tokens=sampling.skip_special_tokens,
            stop=sampling.stop, include_stop_str_in_output=sampling.include_stop_str_in_output)
        self.request = request
        self.decode_instance_id = ""  # the instance streaming now (the dispatcher sets it for each call)
        self.eos_token_ids = eos_token_ids
        self.num_prompt = len(request.prompt_token_ids)
        self.output_token_ids: list[int] = []  # every token received, from every instance
        self.num_messages = 0
        # Kept from the message that carried them, in case later ones leave them unset; after a
        # migration, the first instances' (the prompt's cache and prefill, not the recompute's).
        self.num_cached, self.prefill_id = 0, ""
        self.migrated = False

    def migrate(self) -> list[int]:
        """The output so far, which another decode instance resumes after (its messages follow)."""
        self.migrated = True
        return list(self.output_token_ids)

    def apply(self, output: DecodeOutput) -> GenerationDelta:
        """The delta for one message; finish_reason is set when the request is over
        (decode finished it, or a stop string matched and the rest is unwanted)."""
        request, detokenizer = self.request, self.detokenizer
        first = self.num_messages == 0
        self.num_messages += 1
        self.output_token_ids += output.token_ids
        if not self.migrated:
            self.num_cached = output.num_cached_tokens or self.num_cached
            self.prefill_id = output.prefill_instance_id or self.prefill_id
        delta = GenerationDelta(
            request_id=request.request_id,
            text=detokenizer.update(output.token_ids,
                                    stopped=output.finish_reason is not None and output.stop_token_id is not None),
            usage=Usage(self.num_prompt, len(self.output_token_ids), self.num_cached),
            token_ids=output.token_ids if request.return_token_ids else [],
            logprobs=list(zip(output.token_ids, output.logprobs)) if request.return_logprobs else [],
            prompt_logprobs=output.prompt_logprobs,
            prompt_token_ids=list(request.prompt_token_ids) if first and request.return_token_ids else [],
            prefill_instance_id=self.prefill_id,
            decode_instance_id=output.decode_instance_id or self.decode_instance_id)
        if detokenizer.finished:
            delta.finish_reason, delta.stop_string = FINISH_STOP, detokenizer.stop_string
        elif output.finish_reason is not None:
            delta.text += detokenizer.flush()
            delta.finish_reason = output.finish_reason
            if output.stop_token_id is not None and output.stop_token_id not in self.eos_token_ids:
                delta.stop_token_id = output.stop_token_id
        return delta
