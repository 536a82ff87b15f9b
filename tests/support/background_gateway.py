"""An in-process gateway for synchronous code (tests, notebooks): the real
GatewayServer on 127.0.0.1, on an event loop in a background thread.

    with BackgroundGateway(GatewaySettings(policy="round_robin")) as gw:
        fake = gw.add_fake_decode("decode-0", token_ids=[...])   # optional
        Client(gw.address).generate("Hello")

Anything touching the gateway's state goes through `gw.call(coroutine_or_function)`,
which runs it on the gateway's loop (the registry is single-threaded).
"""
from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

from gateway.core import GatewaySettings
from bench.fakes.fake_decode import FakeDecode
from gateway.server import GatewayServer
from gateway.validation import ServedModel, load_served_model


class BackgroundGateway:
    def __init__(self, settings: GatewaySettings | None = None, model: ServedModel | None = None,
                 **server_kwargs):
        self._settings = settings or GatewaySettings()
        self._model = model
        self._server_kwargs = server_kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gateway-loop", daemon=True)
        self.server: GatewayServer | None = None
        self.fakes: list[FakeDecode] = []

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def registry_address(self) -> str:
        """Where instances register (the gateway's internal registry port)."""
        return self.server.registry_address

    @property
    def gateway(self):
        return self.server.gateway

    def call(self, work: Callable[[], Any] | Any, timeout_s: float = 30.0) -> Any:
        """Run a coroutine, or a plain function, on the gateway's loop; return its result."""
        async def run():
            result = work() if callable(work) and not inspect.iscoroutine(work) else work
            return await result if inspect.isawaitable(result) else result
        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout_s)

    def start(self) -> str:
        self._thread.start()
        model = self._model or load_served_model(None)

        async def start() -> str:  # grpc.aio objects belong to the loop they are made on
            self.server = GatewayServer(model, self._settings, **self._server_kwargs)
            return await self.server.start()
        return self.call(start())

    def add_fake_decode(self, instance_id: str, **kwargs) -> FakeDecode:
        """A FakeDecode (bench.fakes.fake_decode) on this loop, registered before this returns;
        it serves the gateway's model unless `model_name` says otherwise."""
        kwargs.setdefault("model_name", self.gateway.model.name)
        kwargs.setdefault("registry_token", self._server_kwargs.get("registry_token"))

        async def start() -> FakeDecode:
            fake = FakeDecode(instance_id, self.registry_address, **kwargs)
            await fake.start()
            return fake
        fake = self.call(start())
        self.fakes.append(fake)
        return fake

    def remove_fake_decode(self, fake: FakeDecode, grace_s: float | None = None) -> None:
        self.fakes.remove(fake)
        self.call(fake.stop(grace_s))

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the gateway (draining its requests for up to drain_timeout_s), then the fakes."""
        if self.server is not None:
            self.call(self.server.stop(drain_timeout_s), timeout_s=drain_timeout_s + 30)
        for fake in list(self.fakes):
            self.remove_fake_decode(fake, 0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> "BackgroundGateway":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
