"""The flags every engine service takes (`pdserve prefill|decode`), and the addresses
that follow from them. Every flag can also be set as PDSERVE_<FLAG> in the environment."""
from __future__ import annotations

import argparse
import os
import socket

from common.engine.engine_args import add_engine_args
from common.service.logging_setup import add_logging_args
from common.service.metrics import add_metrics_args
from common.service.tracing import add_tracing_args


class EnvDefaultsParser(argparse.ArgumentParser):
    """Flags take their default from PDSERVE_<FLAG_NAME> when that variable is set.

    Applied when parsing (and for --help) rather than in add_argument, so flags added
    through argument groups (whose add_argument bypasses the parser's) get it too."""

    def parse_known_args(self, args=None, namespace=None):
        self._apply_env_defaults()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._apply_env_defaults()
        return super().format_help()

    def _apply_env_defaults(self) -> None:
        for action in self._actions:  # shared with every argument group of this parser
            if not action.option_strings or action.dest == "help" or getattr(action, "_env_applied", False):
                continue
            action._env_applied = True
            env_name = "PDSERVE_" + action.dest.upper()
            if env_name in os.environ:
                raw = os.environ[env_name]
                if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse.BooleanOptionalAction)):
                    action.default = raw.lower() in ("1", "true", "yes", "on")
                else:
                    try:
                        action.default = _env_value(action, raw)
                    except (TypeError, ValueError):
                        self.error(f"{env_name}={raw!r} is not a valid value for {action.option_strings[0]}")
            if action.help and action.help is not argparse.SUPPRESS:
                action.help += f" [env {env_name}]"


def _env_value(action: argparse.Action, raw: str):
    convert = action.type or str
    if action.nargs in ("+", "*"):  # several values, space-separated as on a command line
        return [convert(value) for value in raw.split()] or None
    return convert(raw)


def gateway_addresses(value: str) -> list[str]:
    """"host:port,host:port" -> ["host:port", "host:port"]; each entry needs a port."""
    addresses = [a.strip() for a in value.split(",") if a.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"gateway address {address!r} is not HOST:PORT")
    return addresses


class GatewayAddressesAction(argparse.Action):
    """--gateway A --gateway B,C: the union, in order. Given on the command line, the flag
    replaces PDSERVE_GATEWAY's list rather than adding to it, like every other flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        current = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, current + [a for a in values if a not in current])


def make_parser(role: str, description: str) -> argparse.ArgumentParser:
    parser = EnvDefaultsParser(prog=f"pdserve {role}", description=description)
    g = parser.add_argument_group("service")
    g.add_argument("--host", default="127.0.0.1",
                   help="interface for the gRPC server and ZeroMQ sockets (loopback by default)")
    g.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one")
    g.add_argument("--advertise-address", default=None,
                   help="host:port the gateway and peers use to reach this instance; "
                        "default host:actual_port (the hostname when --host is 0.0.0.0)")
    g.add_argument("--instance-id", default=None, help=f"default {role}-HOSTNAME-PID-RANDOM (unique per process)")
    g.add_argument("--gateway", type=gateway_addresses, action=GatewayAddressesAction, default=[],
                   help="the gateways' registry addresses to register with (host:port of their --registry-port, "
                        "not the public port): repeat the flag or give a comma list; a hostname that resolves "
                        "to several addresses (a headless Service, a compose service with --scale) means "
                        "every one of them, re-resolved while running; none: serve unregistered")
    g.add_argument("--registry-token", default=None,
                   help="the deployment's registry token, sent with every registry call; prefer the "
                        "environment variable to the command line")
    g.add_argument("--events-port", type=int, default=0,
                   help="ZeroMQ PUB port for KV cache events, by which the gateway places prompts where "
                        "their prefix is cached (0 picks a free one)")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT")
    g.add_argument("--grammar-warm-up", action=argparse.BooleanOptionalAction, default=True,
                   help="build the structured-output backend (xgrammar over the model's vocabulary) while the "
                        "model loads, so the first constrained request does not wait for it; --no-grammar-warm-up "
                        "leaves it to that request (~1 CPU-second then, and ~100 MB less memory where none comes)")
    g.add_argument("--served-model-name", default=None, nargs="+",
                   help="model name registered with the gateway (of several, vLLM's form, the first: the "
                        "gateway answers to all); default: --model, or the bundled model's name")
    add_metrics_args(g)
    add_logging_args(g)
    add_tracing_args(g)
    add_engine_args(parser)
    return parser


def served_model_name(args: argparse.Namespace) -> str:
    """The name an instance registers: --served-model-name's first, else --model."""
    from common.engine.model_files import BUNDLED_MODEL_NAME
    names = args.served_model_name
    first = names if isinstance(names, str) else (names or [None])[0]  # a Namespace made in code may hold one
    return first or args.model or BUNDLED_MODEL_NAME


def advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_address:
        return args.advertise_address.rsplit(":", 1)[0].strip("[]")
    if args.host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return args.host


def zmq_bind_endpoint(host: str, port: int) -> str:
    return f"tcp://{host}:{port or '*'}"


def advertised_zmq_endpoint(args: argparse.Namespace, bound_endpoint: str) -> str:
    """The bound socket's endpoint as peers must dial it (port from the bind, host advertised)."""
    return f"tcp://{advertise_host(args)}:{bound_endpoint.rsplit(':', 1)[1]}"


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
