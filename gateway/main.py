"""`pdserve gateway`: run the gateway until SIGTERM or Ctrl-C.

Prints `PDSERVE_READY role=gateway grpc=HOST:PORT registry=HOST:PORT policy=... http=HOST:PORT`
on stdout once it serves (gRPC, and the OpenAI-compatible HTTP API of gateway.openai_api on
the same event loop and Gateway). Instances register at the registry address, an internal
port of its own (--registry-port) that deployments do not publish; with --registry-token
(PDSERVE_REGISTRY_TOKEN) every registry call must carry that token, and a registry
listening beyond loopback refuses to start without one unless --insecure-registry. On
SIGTERM it reports NOT_SERVING, refuses new requests (UNAVAILABLE), lets requests in
flight finish for up to --drain-timeout seconds, then exits 0.
Every flag can also be set as PDSERVE_<FLAG> (common.cli.main.EnvDefaultsParser);
--model, --block-size and --max-model-len share their variables with the
prefill and decode services, so one environment configures a whole deployment.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import os
import signal
import socket
import sys

from common.service.flags import EnvDefaultsParser
from common.service.logging_setup import add_logging_args, configure_logging
from common.service.metrics import add_metrics_args
from common.service.tracing import Tracing, add_tracing_args
from gateway.core import GatewaySettings
from gateway.openai_api.reasoning_parsers import PARSERS as REASONING_PARSERS
from gateway.openai_api.tool_parsers import PARSERS
from gateway.routing.dispatcher import DEFAULT_MIGRATION_LIMIT
from gateway.routing.policies import DEFAULT_KV_LOAD_WEIGHT, POLICIES
from gateway.server import MAX_MESSAGE_BYTES, GatewayServer


def build_parser() -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog="pdserve gateway", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one")
    parser.add_argument("--http-port", default=None, type=_http_port,
                        help="OpenAI-compatible HTTP port (/v1/completions, /v1/chat/completions); 0 picks "
                             "a free one, -1 or 'off' disables it; default 8000, or a free one when --port is 0")
    parser.add_argument("--http-host", default=None, help="interface the HTTP port listens on; default: --host")
    parser.add_argument("--api-key", default=None, type=_api_keys,
                        help="the key(s) clients must send as `authorization: Bearer KEY` on gRPC Generate "
                             "calls and the HTTP API's /v1 routes (comma-separated for several, e.g. while "
                             "rotating); prefer the environment variable to the command line")
    parser.add_argument("--allowed-origins", default=["*"], type=_json_string_list,
                        help="origins whose browser pages may call the HTTP API (CORS), as a JSON list "
                             "(vLLM's flag and default: [\"*\"], any)")
    parser.add_argument("--allowed-methods", default=["*"], type=_json_string_list,
                        help="CORS: methods such pages may use, as a JSON list (default [\"*\"])")
    parser.add_argument("--allowed-headers", default=["*"], type=_json_string_list,
                        help="CORS: headers such pages may send, as a JSON list (default [\"*\"])")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let such pages send credentials (cookies, HTTP auth)")
    parser.add_argument("--ssl-keyfile", default=None,
                        help="serve the HTTP API over TLS (https) with this private key (and --ssl-certfile)")
    parser.add_argument("--ssl-certfile", default=None, help="the TLS certificate (chain) for --ssl-keyfile")
    parser.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    parser.add_argument("--ssl-cert-reqs", default=0, type=int, choices=[0, 1, 2],
                        help="client certificates: 0 not asked (default), 1 optional, 2 required (Python's "
                             "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or a file holding one, used instead of the model's own "
                             "(e.g. one that lists tools)")
    parser.add_argument("--response-role", default="assistant", type=_role,
                        help="the role a chat answer speaks as after the generation prompt (vLLM's flag)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let a chat request bring its own template (`chat_template`, vLLM's flag); "
                             "without it such a request is refused")
    parser.add_argument("--default-chat-template-kwargs", default=None, type=_json_object,
                        help="template variables every chat request gets unless it sets them, as a JSON "
                             "object, e.g. '{\"enable_thinking\": false}'")
    parser.add_argument("--generation-config", default="auto",
                        help="where HTTP requests' default sampling comes from (vLLM's flag): 'auto' the model's "
                             "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty where a "
                             "request leaves them unset; max_new_tokens bounds every request), 'vllm' none, or a "
                             "folder holding such a file")
    parser.add_argument("--override-generation-config", default=None, type=_json_object,
                        help="sampling defaults that add to or replace the generation config's, as a JSON "
                             "object, e.g. '{\"temperature\": 0.5}'")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                        help="the served model's tool-call syntax, read for chat requests with tool_choice "
                             "\"auto\" (OpenAI's default when tools are sent); without it \"auto\" is refused")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="the served model's thinking markers: chat answers carry the thinking as "
                             "`reasoning` and the rest as content, as do gRPC answers asking for "
                             "output.split_reasoning (deepseek_r1: the template opens <think>; "
                             "qwen3: only an answer that opens with <think> reasons)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING): a client may then make the instances read "
                             "adapter directories from their own file systems, so keep the API to trusted "
                             "callers (--api-key)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag, taken for its command lines: \"auto\" is on whenever "
                             "--tool-call-parser is set, and this flag needs it")
    parser.add_argument("--registry-host", default=None,
                        help="interface the instance registry listens on; default: --host")
    parser.add_argument("--registry-port", type=int, default=None,
                        help="internal port instances register at (never publish it); 0 picks a free one; "
                             f"default {DEFAULT_REGISTRY_PORT}, or a free one when --port is 0")
    parser.add_argument("--registry-token", default=None,
                        help="shared secret every registry call must carry (authorization: Bearer TOKEN); "
                             "prefer the environment variable to the command line")
    parser.add_argument("--insecure-registry", action="store_true",
                        help="serve a registry beyond loopback without a token (anyone who reaches it "
                             "can receive users' prompts)")
    parser.add_argument("--event-loop", choices=["uvloop", "asyncio"], default="uvloop",
                        help="event loop serving gRPC and HTTP together")
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face directory (tokenizer and config only; no "
                             "weights are loaded); default: bundled SmolLM2-135M-Instruct")
    parser.add_argument("--served-model-name", default=None, nargs="+",
                        help="name requests and ModelInfo use for the model; default: --model, or the "
                             "bundled model's name (the instances register the same). Several names (vLLM's "
                             "form): requests may use any, answers and ModelInfo name the first, /v1/models "
                             "lists each")
    parser.add_argument("--policy", default="prefix_aware", choices=POLICIES,
                        help="how to choose the prefill instance")
    parser.add_argument("--load-weight", type=float, default=1.0,
                        help="prefix_aware: cost of one queued prefill token vs one uncached prompt token")
    parser.add_argument("--kv-load-weight", type=float, default=DEFAULT_KV_LOAD_WEIGHT,
                        help="prefix_aware, a prompt a decode instance prefills itself: cost of one KV token "
                             "its running requests hold vs one uncached prompt token (Dynamo: 1)")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block; instances with another block size are refused")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="cap on prompt + completion tokens; default: the smallest limit the decode "
                             "instances register, or the model's own before any registers")
    parser.add_argument("--max-prompt-chars", type=int, default=262_144,
                        help="longest prompt text (or chat messages' total) accepted, in characters")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                        help="largest request message accepted")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="seconds between the instances' heartbeats")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat after which an instance is dropped")
    parser.add_argument("--max-running-per-decode", type=int, default=64,
                        help="requests the gateway lets run per live decode instance (keep it at the "
                             "instances' --max-num-seqs); the rest wait in its queue; 0: no limit")
    parser.add_argument("--max-running-per-prefill", type=int, default=64,
                        help="requests the gateway lets be in their prefill (until the first token) per "
                             "live prefill instance; the rest wait in the prefill pool's queue; 0: no limit")
    parser.add_argument("--max-prefill-queue-tokens", type=_non_negative_int, default=0,
                        help="conditional disaggregation by load: a prompt goes to a prefill instance only "
                             "while one has fewer prompt tokens than this still to compute; past it the "
                             "decode instance prefills it itself (its token streams pause for that step). "
                             "Suits a small host where the prefill pool saturates before the decode pool; "
                             "0: always the prefill pool while an instance is alive")
    parser.add_argument("--migration-limit", type=_non_negative_int, default=DEFAULT_MIGRATION_LIMIT,
                        help="times one request may move to another decode instance when its own is lost "
                             "after tokens were streamed (Dynamo's --migration-limit): the new instance "
                             "prefills the prompt and the output so far and continues the stream, greedy and "
                             "seeded sampling as the lost one would have; 0: such a request fails UNAVAILABLE")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests that may wait for capacity, per pool; one more gets RESOURCE_EXHAUSTED "
                             "(HTTP 429) at once, with a retry hint")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let requests in flight finish on SIGTERM")
    add_metrics_args(parser)
    add_logging_args(parser)
    add_tracing_args(parser)
    return parser


DEFAULT_REGISTRY_PORT = 50054


def registry_listen_address(args: argparse.Namespace) -> tuple[str, int]:
    """Where the registry listens; ValueError for a registry beyond loopback with no
    token, unless the operator said --insecure-registry."""
    host = args.registry_host or args.host
    port = args.registry_port if args.registry_port is not None else (0 if args.port == 0 else DEFAULT_REGISTRY_PORT)
    if not args.registry_token and not args.insecure_registry and not _is_loopback(host):
        raise ValueError(f"the registry would listen on {host} without a token: set PDSERVE_REGISTRY_TOKEN "
                         f"(or --registry-token) on the gateway and every instance, or pass "
                         f"--insecure-registry if the network is trusted")
    return host, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname, or "" / 0.0.0.0-like wildcards handled above


def _json(value: str):
    try:
        return json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None


def _json_object(value: str) -> dict:
    parsed = _json(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def _json_string_list(value: str) -> list[str]:
    parsed = _json(value)
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError("must be a JSON list of strings, e.g. '[\"https://example.com\"]'")
    return parsed


def _role(value: str) -> str:
    if not value or not value.isprintable() or len(value) > 64:
        raise argparse.ArgumentTypeError("must be a role name of 1 to 64 printable characters")
    return value


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {number}")
    return number


def _api_keys(value: str) -> list[str]:
    from gateway.api_keys import parse_api_keys
    return parse_api_keys(value)


def _http_port(value: str) -> int:
    from gateway.openai_api.server import parse_http_port
    port = parse_http_port(value)
    return -1 if port is None else port


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    return GatewaySettings(policy=args.policy, block_size=args.block_size, max_model_len=args.max_model_len,
                           max_prompt_chars=args.max_prompt_chars,
                           heartbeat_interval_s=args.heartbeat_interval,
                           heartbeat_timeout_s=args.heartbeat_timeout, load_weight=args.load_weight,
                           kv_load_weight=args.kv_load_weight,
                           max_running_per_decode=args.max_running_per_decode,
                           max_running_per_prefill=args.max_running_per_prefill,
                           max_waiting_requests=args.max_waiting_requests,
                           max_prefill_queue_tokens=args.max_prefill_queue_tokens,
                           migration_limit=args.migration_limit)


async def serve(args: argparse.Namespace) -> None:
    from gateway.validation import load_served_model
    registry_host, registry_port = registry_listen_address(args)
    model = load_served_model(args.model, args.served_model_name, args.chat_template,
                              args.default_chat_template_kwargs, args.trust_request_chat_template,
                              args.generation_config, args.override_generation_config)
    server = GatewayServer(model, settings_from_args(args), host=args.host, port=args.port,
                           max_message_bytes=args.max_message_bytes, metrics_port=args.metrics_port,
                           metrics_host=args.metrics_host, registry_port=registry_port,
                           registry_host=registry_host, registry_token=args.registry_token or None,
                           api_keys=args.api_key, reasoning_parser=args.reasoning_parser,
                           tracing=Tracing("gateway", socket.gethostname(), args.otlp_traces_endpoint))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    address = await server.start()
    http = await _start_http(server, args)  # same loop, same Gateway: one process serves both
    metrics = f" metrics={server.metrics_address}" if server.metrics_address else ""
    http_field = f" http={http.address}" if http else ""
    print(f"PDSERVE_READY role=gateway grpc={address} registry={server.registry_address} policy={args.policy}"
          f"{metrics}{http_field}", flush=True)
    await stop.wait()
    logging.getLogger(__name__).info("shutting down")
    await server.stop(drain_timeout_s=args.drain_timeout)  # HTTP requests drain with the rest
    if http:
        await http.stop()


async def _start_http(server: GatewayServer, args: argparse.Namespace):
    """The OpenAI-compatible HTTP server, or None with --http-port off."""
    from gateway.openai_api.server import CorsPolicy, OpenAIServer, TlsFiles, default_http_port
    port = args.http_port if args.http_port is not None else default_http_port(args.port)
    if port < 0:
        return None
    cors = CorsPolicy(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                      args.allow_credentials)
    tls = (TlsFiles(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
           if args.ssl_keyfile else None)
    http = OpenAIServer(server.gateway, host=args.http_host or args.host, port=port,
                        max_body_bytes=args.max_message_bytes, tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, api_keys=server.api_keys,
                        response_role=args.response_role,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating, cors=cors, tls=tls)
    if args.allow_runtime_lora_updating:
        logging.getLogger(__name__).warning("LoRA adapters may be loaded and unloaded through the HTTP API "
                                            "(--allow-runtime-lora-updating): keep it to trusted callers")
    await http.start()
    return http


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call syntax)")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        parser.error("--ssl-keyfile and --ssl-certfile go together (the key and its certificate)")
    try:
        configure_logging("gateway", f"gateway-{socket.gethostname()}-{os.getpid()}", args.log_level,
                          args.log_format)
        if args.event_loop == "uvloop":  # grpc.aio runs on it; HTTP parsing and sockets are faster
            import uvloop
            uvloop.run(serve(args))
        else:
            asyncio.run(serve(args))
    except (ValueError, OSError) as e:  # bad model path, port taken: a message, not a traceback
        print(f"pdserve gateway: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
