"""The offline API, as in vLLM: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from common.engine.bad_words import with_bad_words_token_ids
from common.engine.block_hash import check_cache_salt
from common.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from common.engine.config import make_engine_config
from common.engine.engine_core import EngineCore
from common.engine.generation_config import load_sampling_defaults
from common.engine.lora.request import LoRARequest
from common.engine.model_files import resolve_model
from common.engine.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprobs,
                                   RequestOutput, ScoringOutput, ScoringRequestOutput)
from common.engine.pooling_params import PoolingParams
from common.engine.scoring import cosine_similarity, score_pairs
from common.engine.request import Request
from common.engine.sampling_params import SamplingParams, truncate_prompt, validate_prompt_token_ids
from common.text.chat_template import ChatTemplateOptions
from common.text.detokenizer import IncrementalDetokenizer, shown_token_ids
from common.text.prompt_tokenizer import load_prompt_tokenizer

PromptType = str | dict


@dataclass
class _Pending:
    prompt_index: int
    sample_index: int
    detokenizer: IncrementalDetokenizer | None  # only when stop strings need watching
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's result


def validate_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens, longer than the maximum model "
                         f"length of {max_model_len} tokens")


def _cache_salt(prompt: PromptType) -> str | None:
    """A dict prompt's cache_salt (vLLM's): its prefix-cache blocks are shared only with
    prompts of the same salt. ValueError for one vLLM's bounds refuse."""
    if not isinstance(prompt, dict) or prompt.get("cache_salt") is None:
        return None
    return check_cache_salt(prompt["cache_salt"])


class LLM:
    def __init__(self, model: str | None = None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **engine_options):
        """engine_options: see common.engine.config.make_engine_config (dtype, device, seed, block_size,
        kv_cache_memory, num_kv_blocks, max_model_len, max_num_seqs, max_num_batched_tokens,
        enable_prefix_caching, enable_chunked_prefill, num_scheduler_steps, speculative_config: a
        SpeculativeConfig or its dict, e.g. {"method": "ngram", "num_speculative_tokens": 4};
        pooler_config: embeddings' pooling over the model's own, e.g. {"pooling_type": "MEAN"}).
        generation_config / override_generation_config (vLLM's): where get_default_sampling_params
        takes its values ("auto": the model's generation_config.json; "vllm": none; a folder)."""
        config = make_engine_config(model, **engine_options)
        model_dir = resolve_model(config.model)  # once: a GGUF's is the digest of the whole file
        # Checked before the engine loads anything: a bad file or flag costs no start-up.
        sampling_defaults = load_sampling_defaults(model_dir, generation_config, override_generation_config)
        self.engine = EngineCore(config, model_dir=model_dir)
        self.sampling_defaults = sampling_defaults
        # tokenizer.json and the chat template without AutoTokenizer: ~1.8 s less start-up.
        self.tokenizer = load_prompt_tokenizer(self.engine.model_dir)
        self.eos_token_ids = tuple(sorted(set(self.engine.model_config.eos_token_ids)
                                          | set(self.tokenizer.eos_token_ids)))
        self._req_counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate samples with when given no sampling_params: SamplingParams()
        with the model's generation config's values (its max_new_tokens as max_tokens)."""
        defaults = self.sampling_defaults
        return SamplingParams(**defaults.sampling,
                              **({"max_tokens": defaults.max_tokens} if defaults.max_tokens else {}))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's LLM.reset_prefix_cache): the next generate
        computes its prompts in full."""
        self.engine.reset_prefix_cache()

    def wait_kv_cache_resident(self, timeout_s: float = 300.0) -> bool:
        """Wait, up to timeout_s, until every runner's CPU KV pool is faulted in (a background
        thread does it after start-up, kernels/huge_pages.py); whether it is. Benchmarks
        call it before their timed runs."""
        return all(self.engine.collective_rpc("wait_kv_cache_resident", (timeout_s,)))

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def _checked_prompt(self, prompt: PromptType,
                        truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, truncated as asked; ValueError where an id is out of
        the vocabulary or the prompt does not fit the model."""
        text, token_ids = self._prompt_token_ids(prompt)
        token_ids = truncate_prompt(token_ids, truncate_prompt_tokens, self.max_model_len)
        validate_prompt_token_ids(token_ids, self.engine.model_config.vocab_size)
        validate_prompt_length(len(token_ids), self.max_model_len)
        return text, token_ids

    def _prompt_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt is a string, {'prompt': text} or {'prompt_token_ids': [...]}; "
                         f"got {type(prompt).__name__}")

    def _lora_requests(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                       num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, every one held by the engine before any request
        is added (so an adapter it refuses leaves nothing behind)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            per_prompt = [lora_request] * num_prompts
        elif len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_requests for {num_prompts} prompts; pass one, or one "
                             f"per prompt")
        else:
            per_prompt = list(lora_request)
        distinct = {lora.lora_name: lora for lora in per_prompt if lora is not None}
        if len(distinct) > self.engine.config.lora.max_loras:
            raise ValueError(f"this call names {len(distinct)} LoRA adapters; the engine holds at most "
                             f"{self.engine.config.lora.max_loras} at once (max_loras)")
        for lora in distinct.values():
            self.engine.hold_lora(lora)
        return per_prompt

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.generate; lora_request: an adapter for every prompt, or one per prompt
        (None: the base model), served where the engine has enable_lora."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                             "pass one, or one per prompt")
        # Validate everything before adding anything, so a bad prompt leaves no request behind.
        vocab_size = self.engine.model_config.vocab_size
        encoded, cache_salts = [], []
        for prompt, params in zip(prompts, sampling_params):
            text, token_ids = self._checked_prompt(prompt, params.truncate_prompt_tokens)
            params = with_bad_words_token_ids(params, self._encode_word)
            params.validate_token_ids(vocab_size)
            encoded.append((text, token_ids, params))
            cache_salts.append(_cache_salt(prompt))
        loras = self._lora_requests(lora_request, len(prompts))
        pending: dict[str, _Pending] = {}
        for i, ((_, token_ids, params), cache_salt, lora) in enumerate(zip(encoded, cache_salts, loras)):
            for j in range(params.n):
                child = params if params.n == 1 else params.for_child(j)
                req_id = str(next(self._req_counter))
                detok = None
                if child.stop:
                    detok = IncrementalDetokenizer(self.tokenizer, token_ids,
                                                   skip_special_tokens=child.skip_special_tokens,
                                                   stop=child.stop,
                                                   include_stop_str_in_output=child.include_stop_str_in_output)
                pending[req_id] = _Pending(i, j, detok)
                self.engine.add_request(Request(req_id, token_ids, child, eos_token_ids=self.eos_token_ids,
                                                cache_salt=cache_salt, lora_request=lora))
        self._run(pending, use_tqdm)
        return self._collect(encoded, pending)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: each conversation through the model's chat template (or
        chat_template, a Jinja template of the caller's), then generate."""
        options = ChatTemplateOptions(add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message,
                                      chat_template_kwargs=chat_template_kwargs, chat_template=chat_template)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(conv, options)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = False, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's embedding, the model's final hidden states pooled as
        its config says (the last token's by default; common.engine.pooling_params), normalized
        unless pooling_params (or, where they leave it unset, the model's sentence-transformers
        config) say otherwise.
        Any model serves it; an embedding model (Qwen3-Embedding, e5-mistral) gives vectors
        meant for it."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        pooling_params = self.engine.pooling_params_for(pooling_params)
        encoded = [self._checked_prompt(prompt, truncate_prompt_tokens)[1] for prompt in prompts]
        cache_salts = [_cache_salt(prompt) for prompt in prompts]
        loras = self._lora_requests(lora_request, len(prompts))
        pending: dict[str, _Pending] = {}
        for i, (token_ids, cache_salt, lora) in enumerate(zip(encoded, cache_salts, loras)):
            req_id = str(next(self._req_counter))
            pending[req_id] = _Pending(i, 0, None)
            self.engine.add_request(Request.embedding(req_id, token_ids, pooling_params, self.eos_token_ids,
                                                      cache_salt=cache_salt, lora_request=lora))
        self._run(pending, use_tqdm)
        results = [None] * len(encoded)
        for req_id, state in pending.items():
            if state.embedding is None:
                raise RuntimeError(f"embedding request {req_id} ended without an embedding "
                                   f"({state.finish_reason})")
            results[state.prompt_index] = EmbeddingRequestOutput(
                request_id=req_id, outputs=EmbeddingOutput(state.embedding),
                prompt_token_ids=encoded[state.prompt_index], num_cached_tokens=state.num_cached_tokens)
        return results

    def score(self, data_1: PromptType | Sequence[PromptType], data_2: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | None = None, use_tqdm: bool = False,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score for an embedding model: each (data_1, data_2) pair's cosine
        similarity (common.engine.scoring), one data_1 against every data_2 (1:N) or pairwise
        (N:N); every prompt of both embedded once, in one batch."""
        queries = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
        documents = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
        pairs = score_pairs(len(queries), len(documents))
        embedded = self.embed(queries + documents, pooling_params, use_tqdm, truncate_prompt_tokens)
        query_outputs, document_outputs = embedded[:len(queries)], embedded[len(queries):]
        results = []
        for query_index, document_index in pairs:
            query, document = query_outputs[query_index], document_outputs[document_index]
            results.append(ScoringRequestOutput(
                request_id=f"{query.request_id}_{document.request_id}",
                outputs=ScoringOutput(cosine_similarity(query.outputs.embedding, document.outputs.embedding)),
                prompt_token_ids=query.prompt_token_ids + document.prompt_token_ids,
                num_cached_tokens=query.num_cached_tokens + document.num_cached_tokens))
        return results

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's beam_width most likely continuations
        (common.engine.beam_search), every step one batch of one-token requests for all
        prompts' live beams. A sequence's token_ids are the prompt's and the beam's, its text
        theirs (vLLM's), an ending EOS left out unless include_stop_str_in_output."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        searches = [BeamSearch(self._checked_prompt(prompt)[1], params, self.eos_token_ids, self.max_model_len)
                    for prompt in prompts]
        progress = tqdm(total=max(s.num_steps for s in searches), desc="beam search", disable=not use_tqdm)
        while running := [s for s in searches if not s.done]:
            beams = [beam for search in running for beam in search.live]
            outputs = self.generate([{"prompt_token_ids": beam.token_ids} for beam in beams], running[0].step_params)
            steps = iter(output.outputs[0].logprobs[0] for output in outputs)
            for search in running:
                search.advance([next(steps) for _ in search.live])
            progress.update(1)
        progress.close()
        results = []
        for search in searches:
            best = search.best()
            for beam in best:
                shown = beam.token_ids[:search.num_prompt_tokens] + search.shown_token_ids(beam)
                beam.text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
            results.append(BeamSearchOutput(sequences=best))
        return results

    def _run(self, pending: dict[str, _Pending], use_tqdm: bool) -> None:
        engine = self.engine
        unfinished = set(pending)
        progress = tqdm(total=len(pending), desc="generate", disable=not use_tqdm)
        try:
            while unfinished:
                stopped: list[str] = []
                for out in engine.step():
                    state = pending.get(out.req_id)
                    if state is None or out.req_id not in unfinished:
                        continue
                    state.token_ids.extend(out.new_token_ids)
                    state.num_cached_tokens = out.num_cached_tokens
                    if out.embedding is not None:
                        state.embedding = out.embedding
                    if out.new_logprobs is not None:
                        state.logprobs = (state.logprobs or []) + out.new_logprobs
                    if out.prompt_logprobs is not None:
                        state.prompt_logprobs = out.prompt_logprobs
                    if state.detokenizer is not None:
                        # The engine finishes a request with "stop" on a stop token only.
                        state.detokenizer.update(out.new_token_ids,
                                                 stopped=out.finished and out.finish_reason == "stop")
                        if state.detokenizer.finished:
                            state.finish_reason, state.stop_reason = "stop", state.detokenizer.stop_string
                            stopped.append(out.req_id)
                    if out.finished and state.finish_reason is None:
                        state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
                    if state.finish_reason is not None:
                        unfinished.discard(out.req_id)
                        progress.update(1)
                if stopped:
                    engine.abort_requests(stopped)
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            engine.abort_requests(list(unfinished))
            raise
        finally:
            progress.close()

    def _collect(self, encoded, pending: dict[str, _Pending]) -> list[RequestOutput]:
        results = [RequestOutput(request_id=str(i), prompt=text, prompt_token_ids=token_ids,
                                 outputs=[], finished=True)
                   for i, (text, token_ids, _) in enumerate(encoded)]
        for state in pending.values():
            params = encoded[state.prompt_index][2]
            if state.detokenizer is not None:
                if not state.detokenizer.finished:
                    state.detokenizer.flush()  # text held back as a possible stop-string start
                text = state.detokenizer.output_text
            else:
                # No stop strings here: a request finished with "stop" was stopped by a token.
                shown = shown_token_ids(state.token_ids, state.finish_reason == "stop",
                                        params.include_stop_str_in_output)
                text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
            result = results[state.prompt_index]
            result.num_cached_tokens = state.num_cached_tokens
            if state.sample_index == 0:  # every sample computed the same prompt
                result.prompt_logprobs = state.prompt_logprobs
            result.outputs.append(CompletionOutput(index=state.sample_index, text=text,
                                                   token_ids=state.token_ids,
                                                   finish_reason=state.finish_reason,
                                                   stop_reason=state.stop_reason, logprobs=state.logprobs))
        for result in results:
            result.outputs.sort(key=lambda o: o.index)
        return results
