"""Fixtures for tests that talk to one real local stack (1 gateway, 1 prefill, 1 decode),
over gRPC and the OpenAI HTTP API. The modules that use it share it (each test leaves it
as it found it: no request running, every block free); a module that needs other
settings defines its own `stack`."""
from __future__ import annotations

import pytest

from common.cli.up import LocalStack
from gateway.client import Client


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("stack-logs")
    # --grammar-warm-up as services start by default (the suite turns it off): the structured
    # outputs tests on this stack see what a deployment does.
    with LocalStack(1, 1, passthrough=["--kv-cache-memory", "256MiB", "--log-level", "WARNING", "--grammar-warm-up"],
                    log_dir=log_dir) as local_stack:
        yield local_stack


@pytest.fixture(scope="module")
def grpc_client(stack):
    with Client(stack.address, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(stack):
    """The official openai client on the stack's HTTP API."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{stack.http_address}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id
