"""The async front of an engine instance's embeddings (prefill and decode roles alike):
one Embed from admission to its vector, in engine terms (the servicer converts
protobuf at the edge)."""
from __future__ import annotations

import grpc

from common.engine.async_engine import AsyncEngine
from common.engine.request import Request
from common.service.embedding_api import EmbedJob, EmbedResult
from common.service.engine_requests import (add_request, admit_when_id_free, checked_cache_salt, finished_output,
                                            open_stream_when_id_free, refused, validate_prompt)
from common.service.errors import ServiceError, invalid
from common.service.lora_modules import LoRAModules


class Embedder:
    def __init__(self, engine: AsyncEngine, core, eos_token_ids: tuple[int, ...], lora_modules: LoRAModules):
        self.engine = engine
        self.core = core  # for the model and its limits (read-only, any thread)
        self.eos_token_ids = eos_token_ids
        self.lora_modules = lora_modules

    async def embed(self, job: EmbedJob) -> EmbedResult:
        if not job.req_id:
            raise invalid("request_id must not be empty")
        validate_prompt(job.prompt_token_ids, self.core)
        try:
            pooling = self.core.pooling_params_for(job.pooling)
        except ValueError as e:  # a bad field is named as the caller sent it
            raise invalid(f"pooling.{e}" if str(e).startswith("dimensions") else str(e)) from None
        request = Request.embedding(job.req_id, job.prompt_token_ids, pooling, self.eos_token_ids, job.priority,
                                    checked_cache_salt(job.cache_salt), self.lora_modules.resolve(job.lora_name))
        try:
            stream = await open_stream_when_id_free(self.engine, job.req_id)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.ALREADY_EXISTS, str(e)) from None
        # Leaving early (the call cancelled) closes the stream, which aborts the request.
        with stream:
            try:
                await admit_when_id_free(lambda: self.engine.call(lambda core: add_request(core, request)))
            except ValueError as e:
                raise refused(e) from None
            output = await finished_output(stream)
        if output.embedding is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"embedding {job.req_id} was aborted "
                               "(the instance is shutting down)")
        return EmbedResult(output.embedding, output.num_cached_tokens)
