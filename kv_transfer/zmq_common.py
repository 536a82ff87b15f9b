"""Pieces both ZeroMQ ends share: CurveZMQ keys, socket options, the wake-up pipe."""
from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

DEFAULT_ENDPOINT = "tcp://127.0.0.1:*"  # loopback, ephemeral port: never all interfaces by default


@dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ keys (Z85 strings, 40 chars).

    The simplest deployment gives every instance the same key pair: a receiver then
    accepts exactly the senders holding that pair's secret key. `server_public_key`
    (sender side) and `allowed_client_keys` (receiver side) allow distinct pairs.
    """

    public_key: str
    secret_key: str
    server_public_key: str | None = None          # default: public_key
    allowed_client_keys: tuple[str, ...] | None = None  # default: (public_key,)

    @classmethod
    def generate(cls) -> "CurveConfig":
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())

    @property
    def allowed(self) -> frozenset[bytes]:
        return frozenset(k.encode() for k in (self.allowed_client_keys or (self.public_key,)))

    def apply_server(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public_key.encode()
        sock.curve_secretkey = self.secret_key.encode()

    def apply_client(self, sock: zmq.Socket, server_public_key: str | None) -> None:
        sock.curve_serverkey = (server_public_key or self.server_public_key or self.public_key).encode()
        sock.curve_publickey = self.public_key.encode()
        sock.curve_secretkey = self.secret_key.encode()


class KeyAllowList:
    """ZAP credentials provider for pyzmq's ThreadAuthenticator: only listed client keys."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._allowed


def common_options(sock: zmq.Socket) -> None:
    sock.linger = 0  # close() must never wait for a peer that is gone
    # Heartbeats drop half-open connections (peer host died without FIN) within seconds.
    sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 5000)


def check_endpoint(endpoint: str) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        raise ValueError(f"ZeroMQ KV endpoint must be tcp:// or ipc://, got {endpoint!r}")


class WakePipe:
    """Lets API threads wake an I/O thread blocked in zmq.Poller (which polls raw fds too)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._pending = False  # a wake-up byte is in flight: skip the syscall

    def wake(self) -> None:
        """Call after enqueueing the command. Skipping the write when a byte is pending is safe
        because drain() clears the flag only after emptying the pipe and before the I/O thread
        reads its queue: a command whose wake() was skipped is still read in that pass."""
        if self._pending:
            return
        self._pending = True
        try:
            os.write(self._write_fd, b"x")
        except (BlockingIOError, OSError):  # full pipe: a wake-up is pending anyway; closed: shutting down
            pass

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        # Only now: clearing first would let a wake() write a byte that the read above eats,
        # leaving the flag set with an empty pipe, and every later wake() skipped for good.
        self._pending = False

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
