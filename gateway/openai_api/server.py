"""The OpenAI-compatible HTTP front: a Starlette app served by uvicorn inside the
gateway's own event loop, next to the gRPC server, on the same Gateway object.

    POST /v1/completions        POST /v1/chat/completions   (stream: server-sent events)
    POST /v1/responses          GET, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
                                (responses_api.py: OpenAI's Responses API, run as the chat completion it means)
    POST /v1/embeddings         (embeddings.py: the prompt's pooled last hidden state)
    POST /score, /rerank        (scores.py: cosine similarities of embeddings; also under /v1/, and /v2/rerank)
    GET  /v1/models             GET  /v1/models/{model}     GET  /version
    GET  /health (liveness)     GET  /ready (readiness)
    POST /tokenize              POST /detokenize            (vLLM's: prompt <-> token ids)
    GET  /openapi.json          (this API's OpenAPI 3.1 document: openapi.py)
    GET  /metrics               (the gateway's Prometheus metrics, as on --metrics-port)
    POST /invocations           GET, POST /ping (SageMaker's routes, as vLLM serves them: by the
                                body's messages / prompt / input; liveness)
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter (vLLM's; only with
                                --allow-runtime-lora-updating: lora_adapters.py)

A request is parsed and checked at the edge (protocol.py), turned into one
GenerateInput per choice and run through Gateway.stream / Gateway.generate, the very
path gRPC Generate takes (placement, detokenization, stop strings, cancellation);
responses.py writes OpenAI's JSON. A stream's status line is sent only once its
first delta is there, so anything that fails before a token (validation, no decode
instance, a full system) gets its proper HTTP status; a failure after that ends the
stream with an error event.

A client that disconnects cancels its request: while a request runs, a watcher
waits on the connection's `http.disconnect`, and the work is cancelled when it comes,
which closes Gateway.stream and so cancels the Decode call (and its prefill).

    http = OpenAIServer(gateway, host="127.0.0.1", port=0)
    address = await http.start()   # "127.0.0.1:PORT"
    ...
    await http.stop()
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import logging
import math
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from common.engine.sampling_params import truncate_prompt
from common.service.errors import ServiceError
from common.service.tracing import trace_headers
from gateway.api_keys import MISSING_KEY_MESSAGE, ApiKeys
from gateway.beam_search import beam_search
from gateway.core import Gateway
from gateway.openai_api.choices import generate_choices, stream_choices
from gateway.openai_api.embeddings import (
    ParsedEmbeddingRequest,
    embed_all,
    embedding_response,
    parse_embedding_request,
)
from gateway.openai_api.errors import ApiError, from_gateway_error, invalid_field
from gateway.openai_api.lora_adapters import (LOAD_PATH, UNLOAD_PATH, LoadLoRAAdapter, loaded_message,
                                              parse_load_request, parse_unload_request, unloaded_message)
from gateway.openai_api.openapi import openapi_document
from gateway.openai_api.protocol import (
    ParsedRequest,
    parse_body,
    parse_detokenize_request,
    parse_request,
    parse_tokenize_request,
)
from gateway.openai_api.scores import (
    ParsedScoreRequest,
    parse_rerank_request,
    parse_score_request,
    score_all,
    scores_response,
)
from gateway.openai_api.responses import ResponseBuilder, TokenTexts, json_bytes
from gateway.openai_api.responses_api import (
    ResponseEvents,
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    as_responses_error,
    completed_response,
    input_items_page,
    not_found,
    parse_responses_request,
    response_object,
    responses_param,
)
from gateway.openai_api.reasoning_parsers import make_reasoning_parser
from gateway.openai_api.tool_parsers import make_tool_parser
from gateway.types import GenerateInput, GenerationDelta

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # like the gRPC server's message limit
try:
    PDSERVE_VERSION = importlib.metadata.version("pdserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was not installed
    PDSERVE_VERSION = "unknown"
PARSE_IN_THREAD_BYTES = 64 << 10
DETOKENIZE_IN_THREAD_TOKENS = 4096
START_TIMEOUT_S = 30.0
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]  # no buffering in a proxy in front


class ClientGone(Exception):
    """The client closed the connection before its response was ready."""


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """Which browser pages may call the API (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials; its defaults: any origin, method and header)."""
    allow_origins: tuple[str, ...] = ("*",)
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    """HTTPS on the API port (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs,
    --ssl-cert-reqs: ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED for client certificates)."""
    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = 0


class OpenAIServer:
    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 8000,
                 max_body_bytes: int = MAX_BODY_BYTES, access_log: bool = False,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 api_keys: ApiKeys | None = None, response_role: str = "assistant",
                 allow_runtime_lora_updating: bool = False, cors: CorsPolicy | None = CorsPolicy(),
                 tls: TlsFiles | None = None):
        self.gateway = gateway
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.tool_parser = make_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = make_reasoning_parser(reasoning_parser) if reasoning_parser else None
        self.response_role = response_role
        # A constrained chat answer may think first: its constraint starts after these tokens.
        self.reasoning_end_token_ids = tuple(gateway.model.tokenizer.encode(
            self.reasoning_parser.end_marker, add_special_tokens=False)) if self.reasoning_parser else ()
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.address = ""
        self.created = int(time.time())
        self.token_text = TokenTexts(gateway.model.tokenizer)
        self.response_store = ResponseStore()  # the Responses API's stored responses
        self._background: dict[str, asyncio.Task] = {}  # background Responses still running, by id
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.stored_input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            *(Route(path, self.score, methods=["POST"]) for path in SCORE_PATHS),
            *(Route(path, self.rerank, methods=["POST"]) for path in RERANK_PATHS),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/invocations", self.invocations, methods=["POST"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            *([Route(LOAD_PATH, self.load_lora_adapter, methods=["POST"]),
               Route(UNLOAD_PATH, self.unload_lora_adapter, methods=["POST"])] if allow_runtime_lora_updating else []),
        ], exception_handlers={HTTPException: _http_exception, Exception: _internal_error})
        if api_keys is not None:
            self.app = _RequireApiKey(self.app, api_keys, self._count_refusal, self._count_embedding_refusal)
        if cors is not None:  # outermost: a preflight is answered here, and a 401 carries the headers too
            self.app = CORSMiddleware(self.app, allow_origins=cors.allow_origins, allow_methods=cors.allow_methods,
                                      allow_headers=cors.allow_headers, allow_credentials=cors.allow_credentials)
        self.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.access_log = access_log
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None
        self._openapi_json: tuple[list[str], bytes] | None = None  # (the model names it lists, the document)

    # --- serving ---------------------------------------------------------------------

    async def start(self) -> str:
        """Bind (port 0: a free one), serve, and return the address clients use."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a live listener still fails
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot bind the OpenAI HTTP server to {self.host}:{self.port}: {e.strerror}") from e
        sock.setblocking(False)
        tls = self.tls
        config = uvicorn.Config(self.app, loop="none", http="httptools", ws="none", lifespan="off",
                                log_config=None, access_log=self.access_log, server_header=False,
                                timeout_graceful_shutdown=5, timeout_keep_alive=30,
                                **({} if tls is None else dict(ssl_keyfile=tls.keyfile, ssl_certfile=tls.certfile,
                                                               ssl_ca_certs=tls.ca_certs, ssl_cert_reqs=tls.cert_reqs)))
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:  # uvicorn offers no event for this
            if self._task.done():
                self._task.result()  # its exception
                raise OSError("the OpenAI HTTP server stopped while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the OpenAI HTTP server did not start within {START_TIMEOUT_S:.0f}s")
            await asyncio.sleep(0.01)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "[::1]" if self.host in ("::", "[::]") else self.host
        self.address = f"{host}:{sock.getsockname()[1]}"
        logger.info("OpenAI-compatible HTTP on %s://%s/v1", self.scheme, self.address)
        return self.address

    async def stop(self) -> None:
        """Stop accepting connections and close them (call after the gateway drained); background
        Responses still running are cancelled (stored as such)."""
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    # --- endpoints -------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: Request) -> Response:
        return await self._generate(request, chat=True, responses_api=True)

    async def stored_input_items(self, request: Request) -> Response:
        """OpenAI's list of a stored response's input items (order, limit, after)."""
        response_id = request.path_params["response_id"]
        stored = self.response_store.get(response_id)
        if stored is None:
            return _error(not_found(response_id))
        query = request.query_params
        try:
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise invalid_field("order", "must be asc or desc")
            limit = query.get("limit", "20")
            if not limit.isdigit() or not 1 <= int(limit) <= 100:
                raise invalid_field("limit", "must be an integer in [1, 100]")
            return _json(input_items_page(stored.input_items, order, int(limit), query.get("after")))
        except ApiError as e:
            return _error(e)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's inference route (vLLM serves it): the body's own fields say which API it
        is for: `messages` chat, `prompt` completions, `input` embeddings."""
        try:
            body = await self._read_body(request)
            fields = parse_body(body)
        except ApiError as e:
            self._count_refusal(e.grpc_code.name)
            return _error(e)
        except ClientDisconnect:
            self._count_refusal("CANCELLED")
            return Response(status_code=499)
        # The handler reads the body again: Starlette's Request replays a body it holds.
        request._body = body
        if "messages" in fields:
            return await self._generate(request, chat=True)
        if "prompt" in fields:
            return await self._generate(request, chat=False)
        if "input" in fields:
            return await self.embeddings(request)
        self._count_refusal("INVALID_ARGUMENT")
        return _error(invalid_field("messages", "an /invocations body holds messages (chat), prompt (completion) "
                                                "or input (embeddings)", code="missing_field"))

    async def stored_response(self, request: Request) -> Response:
        """GET: a stored response as it was answered; DELETE: forget it (OpenAI's shapes)."""
        response_id = request.path_params["response_id"]
        stored = self.response_store.get(response_id)
        if stored is None:
            return _error(not_found(response_id))
        if request.method == "DELETE":
            await self._cancel_background(response_id)
            self.response_store.delete(response_id)
            return _json({"id": response_id, "object": "response", "deleted": True})
        return _json(stored.response)

    async def cancel_response(self, request: Request) -> Response:
        """OpenAI's cancel of a background response: stopped (its Decode calls cancelled) and
        stored `cancelled`; one already finished is answered as it is."""
        response_id = request.path_params["response_id"]
        stored = self.response_store.get(response_id)
        if stored is None:
            return _error(not_found(response_id))
        if not stored.response.get("background"):
            return _error(ApiError(400, "Only responses created with background=true can be cancelled.",
                                   param="response_id", code="invalid_request"))
        await self._cancel_background(response_id)
        stored = self.response_store.get(response_id)
        return _json(stored.response) if stored is not None else _error(not_found(response_id))

    async def _cancel_background(self, response_id: str) -> None:
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def embeddings(self, request: Request) -> Response:
        """OpenAI's embeddings: every input through Gateway.embed (embeddings.py)."""
        async def respond(parsed: ParsedEmbeddingRequest, model_name: str) -> dict:
            response_id = f"embd-{uuid.uuid4().hex}"
            results = await embed_all(self.gateway, parsed.embed_inputs(response_id))
            return embedding_response(parsed, results, response_id, model_name)
        return await self._embedding_route(request, parse_embedding_request, respond, _embedding_param_of)

    async def score(self, request: Request) -> Response:
        """vLLM's /score for an embedding model: the cosine similarity of each pair (scores.py)."""
        return await self._embedding_route(request, parse_score_request, self._scores, _score_param_of)

    async def rerank(self, request: Request) -> Response:
        """vLLM's /rerank (Jina's and Cohere's shape): the documents by their score against the query."""
        return await self._embedding_route(request, parse_rerank_request, self._scores, _score_param_of)

    async def _scores(self, parsed: ParsedScoreRequest, model_name: str) -> dict:
        response_id = f"{'rerank' if parsed.is_rerank else 'score'}-{uuid.uuid4().hex}"
        return scores_response(parsed, await score_all(self.gateway, parsed, response_id), response_id, model_name)

    async def _embedding_route(self, request: Request, parse: Callable[[bytes], Any],
                               respond: Callable[[Any, str], Awaitable[dict]],
                               param_of: Callable[[ServiceError, Any], str | None]) -> Response:
        """A route whose work is embeddings (embeddings, score, rerank): the body parsed, the
        model checked, respond(parsed, model name) until the client leaves; Gateway.embed counts
        each text, and a request refused before it is counted here, once."""
        parsed = None
        try:
            parsed = await _parsed(parse, await self._read_body(request))
            parsed.trace_headers = trace_headers(request.headers)  # each text's span continues the caller's trace
            model_name = self._served_model_name() if parsed.model is None else self._check_model(parsed.model)
            body = await _until_disconnect(request, respond(parsed, model_name))
            return Response(json_bytes(body), media_type="application/json")
        except ServiceError as e:  # Gateway.embed counted it
            return _error(from_gateway_error(e, param_of(e, parsed)))
        except ApiError as e:  # refused here, before the gateway saw it
            self._count_embedding_refusal(e.grpc_code.name)
            return _error(e)
        except ClientDisconnect:
            self._count_embedding_refusal("CANCELLED")
            return Response(status_code=499)
        except ClientGone:  # Gateway.embed counted each text
            return Response(status_code=499)

    async def models(self, request: Request) -> Response:
        """The served model, then each LoRA adapter some instance serves (vLLM's: its parent the base)."""
        return _json({"object": "list", "data": [self._model_card(name) for name in self._model_names()]})

    async def model(self, request: Request) -> Response:
        """OpenAI's model retrieval: the served model or an adapter by a name /v1/models lists, else a 404."""
        name = request.path_params["model"]
        try:
            if name not in self.gateway.model.other_served_names:
                name = self._check_model(name)
        except ApiError as e:
            return _error(e)
        return _json(self._model_card(name))

    async def version(self, request: Request) -> Response:
        return _json({"version": PDSERVE_VERSION})

    def _model_card(self, name: str | None = None) -> dict:
        """The card of the served model, or of the LoRA adapter `name`."""
        info = self.gateway.deployment_info()
        card = {"id": info.model_name, "object": "model", "created": self.created, "owned_by": "pdserve",
                "max_model_len": info.max_model_len}
        if name in self.gateway.model.other_served_names:
            card.update(id=name)
        elif name is not None and name != info.model_name:
            card.update(id=name, root=name, parent=info.model_name)
        return card

    async def tokenize(self, request: Request) -> Response:
        """A prompt's token ids as generation gets them (for logit_bias, allowed_token_ids or
        length checks), with the context length they must fit."""
        try:
            parsed = await _parsed(parse_tokenize_request, await self._read_body(request))
            if parsed.model is not None:
                self._check_model(parsed.model)
            token_ids = await self._tokenized(parsed.prompt)
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        return _json({"count": len(token_ids), "max_model_len": self.gateway.max_model_len, "tokens": token_ids,
                      "token_strs": [self.token_text(t) for t in token_ids] if parsed.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        """Token ids' text, special tokens included (vLLM's)."""
        try:
            model, token_ids = await _parsed(parse_detokenize_request, await self._read_body(request))
            if model is not None:
                self._check_model(model)
            vocab_size = self.gateway.model.vocab_size
            bad = next((i for i, t in enumerate(token_ids) if t >= vocab_size), None)
            if bad is not None:
                raise invalid_field(f"tokens[{bad}]", f"token id {token_ids[bad]} is out of range [0, {vocab_size}) "
                                                      f"for vocab size {vocab_size}")
            decode = self.gateway.model.tokenizer.decode
            text = (await asyncio.to_thread(decode, token_ids, False) if len(token_ids) > DETOKENIZE_IN_THREAD_TOKENS
                    else decode(token_ids, False))
        except ApiError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)
        return _json({"prompt": text})

    async def load_lora_adapter(self, request: Request) -> Response:
        """Load a LoRA adapter on every instance that runs with LoRA (gateway.lora_adapters)."""
        async def load(parsed: LoadLoRAAdapter) -> str:
            await self.gateway.lora_adapters.load(parsed.lora_name, parsed.lora_path, parsed.load_inplace)
            return loaded_message(parsed.lora_name)
        return await self._lora_change(request, parse_load_request, load)

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload a LoRA adapter from every instance that serves it."""
        async def unload(lora_name: str) -> str:
            await self.gateway.lora_adapters.unload(lora_name)
            return unloaded_message(lora_name)
        return await self._lora_change(request, parse_unload_request, unload)

    async def _lora_change(self, request: Request, parse: Callable[[bytes], Any],
                           change: Callable[[Any], Awaitable[str]]) -> Response:
        """A run-time LoRA change: its body parsed, the change made, answered with vLLM's line."""
        try:
            return PlainTextResponse(await change(await _parsed(parse, await self._read_body(request))))
        except ApiError as e:
            return _error(e)
        except ServiceError as e:
            return _error(from_gateway_error(e))
        except ClientDisconnect:
            return Response(status_code=499)

    async def openapi(self, request: Request) -> Response:
        """This API's OpenAPI document (openapi.py), made again only when the names a request's
        model may take change (LoRA adapters registered, loaded or unloaded)."""
        model_names = self._model_names()
        if self._openapi_json is None or self._openapi_json[0] != model_names:
            self._openapi_json = (model_names, json_bytes(openapi_document(
                model_names, PDSERVE_VERSION, self.gateway.model.trust_request_chat_template,
                self.allow_runtime_lora_updating)))
        return Response(self._openapi_json[1], media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        """The gateway's Prometheus metrics on the API port too, where vLLM serves them (a
        scrape config written for vLLM works); --metrics-port serves the same registry."""
        return Response(generate_latest(self.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(self, request: Request) -> Response:
        """Liveness: the process serves (503 only once it drains to stop)."""
        if self.gateway.draining:
            return _json({"status": "draining"}, status=503)
        return _json({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """Readiness (gateway.readiness): 503 with the reason while nothing can be served."""
        reason = self.gateway.readiness.reason
        if reason is not None:
            return _json({"status": "not ready", "reason": reason}, status=503)
        return _json({"status": "ready"})

    async def _generate(self, request: Request, chat: bool, responses_api: bool = False) -> Response:
        """A completion or chat completion; responses_api: a Responses request, run as the
        chat completion it means (responses_api.py) and answered as a Response."""
        parsed = asked = None
        try:
            body = await self._read_body(request)
            if responses_api:
                asked = await _parsed(parse_responses_request, body)
                asked.continue_stored(self.response_store)
                try:
                    parsed = await self._responses_chat(asked)
                except ApiError as e:
                    raise as_responses_error(e) from None
            else:
                parsed = await _parsed(parse_request, body, chat, self.tool_parser, self.response_role,
                                       self.gateway.model.sampling_defaults)
            model_name = self._check_model(parsed.model)
            if chat and self.reasoning_end_token_ids:
                await self._constrain_after_reasoning(parsed)
            response_id = asked.response_id if asked else f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            inputs = parsed.generate_inputs(response_id)
            caller_trace = trace_headers(request.headers)  # each choice's span continues the caller's trace
            for generate_input in inputs:
                generate_input.trace_headers = caller_trace
            builder = ResponseBuilder(parsed, response_id, model_name, self.token_text,
                                      await self._echo_prompts(parsed) if parsed.echo else None,
                                      self.reasoning_parser)
            if asked is not None and asked.background:
                return self._start_background(asked, parsed, inputs, builder, model_name)
            if parsed.stream:
                writer = builder if asked is None else ResponseEvents(builder, asked, model_name,
                                                                      self._stored_by(asked))
                return await self._start_stream(request, writer, stream_choices(self.gateway, inputs))
            results = await _until_disconnect(request, self._whole_choices(parsed, inputs))
            answer = builder.full_response(results)
            if asked is not None:
                answer, conversation = completed_response(asked, model_name, answer, parsed.sampling)
                self._stored_by(asked)(answer, conversation)
            return Response(json_bytes(answer), media_type="application/json")
        except ServiceError as e:  # Gateway.stream counted it
            param = _param_of(e, parsed)
            return _error(from_gateway_error(e, responses_param(param) if asked else param))
        except ApiError as e:  # refused here, before the gateway saw it
            self._count_refusal(e.grpc_code.name)
            return _error(e)
        except ClientDisconnect:  # gone while sending its body: never reached the gateway
            self._count_refusal("CANCELLED")
            return Response(status_code=499)  # nobody reads it; nginx's code for this case
        except ClientGone:  # gone while the gateway served it (Gateway.stream counted it)
            return Response(status_code=499)

    async def _responses_chat(self, asked: ResponsesRequest) -> ParsedRequest:
        """The chat request a Responses request means; with truncation "auto", the fewest of
        its oldest turns dropped for the prompt to fit the model with room for
        max_output_tokens (found by bisection: a long chain's prompt is rendered a few times,
        not once per turn); the conversation stored with the answer is the one that fitted."""
        parsed = await self._chat_of(asked)
        if asked.values.get("truncation") != "auto" or await self._fits(asked, parsed):
            return parsed
        whole, starts = asked.conversation, asked.turn_starts()
        fitting = None  # (first turn kept, its chat request): the fewest turns dropped so far
        low, high = 1, len(starts) - 1  # dropping fewer than `low` turns does not fit
        while low <= high:
            middle = (low + high) // 2
            asked.conversation = whole[starts[middle]:]
            candidate = await self._chat_of(asked)
            if await self._fits(asked, candidate):
                fitting, high = (middle, candidate), middle - 1
            else:
                low = middle + 1
        if fitting is None:  # the last turn alone does not fit: refused as a prompt too long
            asked.conversation = whole[starts[-1]:]
            return await self._chat_of(asked)
        asked.conversation = whole[starts[fitting[0]]:]
        return fitting[1]

    async def _chat_of(self, asked: ResponsesRequest) -> ParsedRequest:
        return await _parsed(parse_request, json_bytes(asked.chat_body()), True, self.tool_parser,
                             self.response_role, self.gateway.model.sampling_defaults)

    async def _fits(self, asked: ResponsesRequest, parsed: ParsedRequest) -> bool:
        prompt = GenerateInput(messages=parsed.messages, chat_options=parsed.chat_options,
                               add_special_tokens=parsed.add_special_tokens)
        room = asked.values.get("max_output_tokens") or 1
        return len(await self._tokenized(prompt)) + room <= self.gateway.max_model_len

    def _whole_choices(self, parsed: ParsedRequest, inputs: list[GenerateInput]) -> Awaitable[list]:
        """Every choice's whole completion (a beam search's best beams where it asks for one)."""
        if parsed.beam_search is not None:
            return self._beam_search(parsed, inputs)
        return generate_choices(self.gateway, inputs)

    def _start_background(self, asked: ResponsesRequest, parsed: ParsedRequest, inputs: list[GenerateInput],
                          builder: ResponseBuilder, model_name: str) -> Response:
        """A background Response: stored `queued`, run on a task of its own, answered at once."""
        queued = response_object(asked, model_name, parsed.sampling, "queued", [], None)
        self._stored_by(asked)(queued, [])
        response_id = asked.response_id
        task = asyncio.create_task(self._run_background(asked, parsed, inputs, builder, model_name))
        self._background[response_id] = task
        task.add_done_callback(lambda _: self._background.pop(response_id, None))
        return _json(queued)

    async def _run_background(self, asked: ResponsesRequest, parsed: ParsedRequest, inputs: list[GenerateInput],
                              builder: ResponseBuilder, model_name: str) -> None:
        """Run it as a foreground request would, keeping its status in the store as it goes."""
        keep = self._stored_by(asked)
        keep(response_object(asked, model_name, parsed.sampling, "in_progress", [], None), [])
        try:
            results = await self._whole_choices(parsed, inputs)
            answer, conversation = completed_response(asked, model_name, builder.full_response(results),
                                                      parsed.sampling)
        except asyncio.CancelledError:
            keep(response_object(asked, model_name, parsed.sampling, "cancelled", [], None), [])
            raise
        except Exception as e:  # noqa: BLE001 -- whatever ended it, the stored response must say failed
            error = (from_gateway_error(e, responses_param(_param_of(e, parsed))) if isinstance(e, ServiceError)
                     else ApiError(500, f"the response failed: {e}"))
            if not isinstance(e, ServiceError):
                logger.exception("background response %s failed", asked.response_id)
            keep(response_object(asked, model_name, parsed.sampling, "failed", [], None,
                                 error={"code": error.code or "server_error", "message": error.message}), [])
            return
        keep(answer, conversation)

    def _stored_by(self, asked: ResponsesRequest) -> Callable[[dict, list[dict]], None]:
        """What keeps a finished Response for GET and previous_response_id (store: true)."""
        def keep(response: dict, conversation: list[dict]) -> None:
            if asked.store:
                self.response_store.put(StoredResponse(response, conversation, asked.input_items))
        return keep

    async def _tokenized(self, prompt: GenerateInput) -> list[int]:
        """prompt's token ids as generation gets them; a refusal is an ApiError naming the
        field (the edge counts it: no gateway request ever carries it)."""
        try:
            return await self.gateway.tokenize(prompt)
        except ServiceError as e:
            field = "messages" if prompt.messages is not None else "prompt"
            raise from_gateway_error(e, "chat_template" if e.message.startswith("chat_template") else field) from None

    async def _beam_search(self, parsed: ParsedRequest, inputs: list[GenerateInput]) -> list[GenerationDelta]:
        """Each prompt's beams, best first, as its n choices (one search per prompt)."""
        results = []
        for prompt in inputs[::parsed.sampling.n]:
            completions = await beam_search(self.gateway, prompt, await self._tokenized(prompt), parsed.beam_search)
            results += [completion.delta for completion in completions]
        return results

    async def _constrain_after_reasoning(self, parsed: ParsedRequest) -> None:
        """Let a reasoning model think before a structured output or a forced tool call
        (vLLM's): the constraint starts after the end-of-thinking marker, unless the prompt
        closed the thinking."""
        constraint = parsed.sampling.structured_outputs
        if constraint is None:
            return
        prompt_token_ids = await self._tokenized(GenerateInput(
            messages=parsed.messages, chat_options=parsed.chat_options, add_special_tokens=parsed.add_special_tokens))
        prompt = self.gateway.model.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        if not self.reasoning_parser.closed_in(prompt):
            parsed.sampling = parsed.sampling.clone(structured_outputs=dataclasses.replace(
                constraint, start_after_token_ids=self.reasoning_end_token_ids))

    async def _echo_prompts(self, parsed: ParsedRequest) -> list[tuple[str, list[int]]]:
        """Each prompt's text and token ids (as generation tokenizes and truncates it), for echo."""
        echoed = []
        for prompt in parsed.prompts:
            token_ids = prompt if not isinstance(prompt, str) else await self._tokenized(
                GenerateInput(text=prompt, add_special_tokens=parsed.add_special_tokens))
            try:
                kept = truncate_prompt(token_ids, parsed.sampling.truncate_prompt_tokens, self.gateway.max_model_len)
            except ValueError as e:
                raise invalid_field("truncate_prompt_tokens", str(e).split(": ", 1)[-1]) from None
            if isinstance(prompt, str) and len(kept) == len(token_ids):
                echoed.append((prompt, token_ids))
            else:
                echoed.append((self.gateway.model.tokenizer.decode(kept, skip_special_tokens=False), kept))
        return echoed

    def _count_refusal(self, status: str) -> None:
        """A request the HTTP edge ended itself is still a request: counted under its status
        in pdserve_requests_total like the ones the gateway (or the gRPC edge) refuses."""
        self.gateway.metrics.request_timer().finish(status)

    def _count_embedding_refusal(self, status: str) -> None:
        """An embedding request the HTTP edge refused, counted in pdserve_embeddings_total."""
        self.gateway.metrics.embedding_finished(status, 0, 0.0)

    async def _start_stream(self, request: Request, writer: ResponseBuilder | ResponseEvents,
                            events: AsyncIterator[tuple[int, GenerationDelta]]) -> Response:
        try:
            first = await _until_disconnect(request, anext(events))
        except BaseException:
            await events.aclose()
            raise
        return _EventStream(writer, first, events)

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _too_large(int(declared), self.max_body_bytes)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(size, self.max_body_bytes)
            chunks.append(chunk)
        return b"".join(chunks)

    def _model_names(self) -> list[str]:
        """What /v1/models lists: the served model (under each of --served-model-name's names),
        then each LoRA adapter some instance serves."""
        return [self._served_model_name(), *self.gateway.model.other_served_names,
                *self.gateway.registry.lora_names()]

    def _served_model_name(self) -> str:
        return self.gateway.registry.model_name or self.gateway.model.name  # as ModelInfo says

    def _check_model(self, name: str) -> str:
        """The served name, or the LoRA adapter's; 404 (as OpenAI answers) for any other model."""
        served = self._served_model_name()
        if name in self.gateway.registry.lora_names():
            return name
        if name != served and name not in self.gateway.model.aliases:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {served!r} "
                                f"(GET /v1/models)", param="model", code="model_not_found")
        return served


# What an API key guards: the generation and model routes (vLLM's /v1) and the tokenizer's.
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
_GUARDED_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/invocations", *SCORE_PATHS, *RERANK_PATHS)
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations")
# Requests whose work is embeddings, counted in pdserve_embeddings_total.
_EMBEDDING_PATHS = ("/v1/embeddings", *SCORE_PATHS, *RERANK_PATHS)


class _RequireApiKey:
    """ASGI middleware: a guarded route without one of the keys is a 401 (OPTIONS, a CORS
    preflight, passes); refused generation and embedding requests are counted like every other refusal."""

    def __init__(self, app, api_keys: ApiKeys, count_refusal, count_embedding_refusal):
        self.app, self.api_keys = app, api_keys
        self.count_refusal, self.count_embedding_refusal = count_refusal, count_embedding_refusal

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS" or not path.startswith(_GUARDED_PREFIXES)
                or self.api_keys.accepts(dict(scope["headers"]).get(b"authorization"))):
            await self.app(scope, receive, send)
            return
        if path.rstrip("/") in _GENERATION_PATHS:
            self.count_refusal("UNAUTHENTICATED")
        elif path.rstrip("/") in _EMBEDDING_PATHS:
            self.count_embedding_refusal("UNAUTHENTICATED")
        error = ApiError(401, MISSING_KEY_MESSAGE, code="invalid_api_key")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": error.body_bytes()})


class _EventStream(Response):
    """A server-sent-event stream that stops (and closes `events`, cancelling the
    request) as soon as the client disconnects. `writer` (a chat or completions
    ResponseBuilder, or the Responses API's ResponseEvents) writes each delta's events
    and the stream's end."""

    def __init__(self, writer: ResponseBuilder | ResponseEvents, first: tuple[int, GenerationDelta],
                 events: AsyncIterator[tuple[int, GenerationDelta]]):
        # Not Response.__init__: it would declare an empty body (content-length: 0).
        self.status_code, self.background = 200, None
        self.raw_headers = SSE_HEADERS
        self.writer, self.first, self.events = writer, first, events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            watcher = asyncio.ensure_future(_wait_disconnect(receive))
            try:
                await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pump, watcher):
                    task.cancel()
                await asyncio.gather(pump, watcher, return_exceptions=True)
            if pump.done() and not pump.cancelled() and pump.exception() is not None:
                raise pump.exception()
        finally:
            await self.events.aclose()

    async def _pump(self, send) -> None:
        writer = self.writer
        error = None
        try:
            # Each chunk goes out the moment its delta is here: holding one back to
            # send it with the next would delay every token by one inter-token gap.
            await send({"type": "http.response.body", "body": writer.chunk(*self.first), "more_body": True})
            async for index, delta in self.events:
                await send({"type": "http.response.body", "body": writer.chunk(index, delta), "more_body": True})
        except ServiceError as e:
            error = from_gateway_error(e)
        await send({"type": "http.response.body", "body": writer.ending(error), "more_body": False})


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a loop it does not own: SIGTERM/SIGINT stay the gateway's
    (it drains before anything stops)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, work: Awaitable):
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _parsed(parse, body: bytes, *args):
    """parse(body, *args); a big body's off the loop, so the streams it serves keep going."""
    if len(body) > PARSE_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse, body, *args)
    return parse(body, *args)


def _param_of(error: ServiceError, parsed: ParsedRequest | None) -> str | None:
    """The request field a gateway or engine validation message is about, where it says."""
    message = error.message
    if parsed is None or error.code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    if "max_tokens" in message:
        return "max_tokens"
    if message.startswith("chat_template"):
        return "chat_template"
    if message.startswith(("prompt", "the prompt", "messages", "chat template")):
        return "messages" if parsed.chat else "prompt"
    if message.startswith("structured_outputs."):  # the engine's grammar compiler refused it
        return parsed.constraint_field
    # Out of the vocabulary, past the model's length, a word too many tokens long ("bad_words[2] is",
    # "bad_words_token_ids: token id"): each message starts with the field.
    for name in ("stop_token_ids", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens", "bad_words"):
        if message.startswith(f"sampling.{name}"):
            return name
    return None


def _embedding_param_of(error: ServiceError, parsed: ParsedEmbeddingRequest | None) -> str | None:
    """The embedding request's field a gateway or instance refusal is about."""
    if parsed is None or error.code != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    message = error.message
    for prefix, param in (("truncate_prompt_tokens", "truncate_prompt_tokens"), ("pooling.dimensions", "dimensions"),
                          ("chat_template", "chat_template")):
        if message.startswith(prefix):
            return param
    return "messages" if parsed.messages is not None else "input"


def _score_param_of(error: ServiceError, parsed: ParsedScoreRequest | None) -> str | None:
    """The /score or /rerank field (and item) a refusal is about: what scores.score_all marked."""
    return getattr(error, "param", None)


def _json(payload: dict, status: int = 200) -> Response:
    return Response(json_bytes(payload), status_code=status, media_type="application/json")


def _error(error: ApiError) -> Response:
    headers = None if error.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(error.retry_after_s)))}
    return Response(error.body_bytes(), status_code=error.status, media_type="application/json", headers=headers)


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes, more than this server's limit of {limit}",
                    code="body_too_large")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                           code="not_found" if exc.status_code == 404 else None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # A bug: Starlette re-raises it after this response, and uvicorn logs the traceback.
    return _error(ApiError(500, f"gateway error: {exc!r}"))


DEFAULT_HTTP_PORT = 8000


def default_http_port(grpc_port: int) -> int:
    """--http-port left unset: 8000, or a free port (0) when the gRPC port is picked freely too."""
    return 0 if grpc_port == 0 else DEFAULT_HTTP_PORT


def parse_http_port(value: str) -> int | None:
    """--http-port: a port, 0 for a free one, -1 or "off" for no HTTP server (None)."""
    if value.strip().lower() in ("off", "-1"):
        return None
    try:
        port = int(value)
    except ValueError:
        port = -2
    if not 0 <= port <= 65535:
        raise ValueError(f"{value} is not a port (0-65535, or -1/off to disable)")
    return port
