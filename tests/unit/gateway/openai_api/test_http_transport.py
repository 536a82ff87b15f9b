"""The HTTP API's transport, as vLLM's serve sets it up: CORS (any origin by default, or
the --allowed-* lists; a preflight needs no API key) and TLS (--ssl-keyfile /
--ssl-certfile: https only), on a real in-process gateway and uvicorn on 127.0.0.1."""
from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
from contextlib import contextmanager

import pytest

from gateway.api_keys import ApiKeys
from gateway.core import GatewaySettings
from gateway.openai_api.server import CorsPolicy, OpenAIServer, TlsFiles
from tests.support.background_gateway import BackgroundGateway
from tests.unit.gateway.openai_api.test_server import MODEL, TOKENS

PAGE = "https://chat.example.com"


@contextmanager
def served(**server_kwargs):
    """A gateway with one fake decode instance and the OpenAI server built with server_kwargs."""
    with BackgroundGateway(GatewaySettings(heartbeat_timeout_s=30.0)) as gw:
        gw.add_fake_decode("decode-0", token_ids=TOKENS)
        server = gw.call(lambda: OpenAIServer(gw.gateway, port=0, **server_kwargs))
        address = gw.call(server.start())
        try:
            yield address
        finally:
            gw.call(server.stop())


def call(address: str, method: str, path: str, headers: dict, body: dict | None = None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = address.split(":")
    connection = (http.client.HTTPSConnection(host, int(port), timeout=30, context=context) if context
                  else http.client.HTTPConnection(host, int(port), timeout=30))
    try:
        connection.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                           headers={"content-type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


PREFLIGHT = {"origin": PAGE, "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}
COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}


def test_any_page_may_call_by_default_and_a_preflight_needs_no_key():
    with served(api_keys=ApiKeys(["secret"])) as address:
        status, headers, _ = call(address, "OPTIONS", "/v1/completions", PREFLIGHT)
        assert status == 200 and headers["access-control-allow-origin"] == "*"
        assert "POST" in headers["access-control-allow-methods"]
        status, headers, _ = call(address, "POST", "/v1/completions",
                                  {"origin": PAGE, "authorization": "Bearer secret"}, COMPLETION)
        assert status == 200 and headers["access-control-allow-origin"] == "*"
        status, headers, _ = call(address, "POST", "/v1/completions", {"origin": PAGE}, COMPLETION)
        assert status == 401 and headers["access-control-allow-origin"] == "*"  # the page can read why


def test_listed_origins_only_and_no_cors_at_all():
    policy = CorsPolicy(allow_origins=(PAGE,), allow_credentials=True)
    with served(cors=policy) as address:
        status, headers, _ = call(address, "OPTIONS", "/v1/completions", PREFLIGHT)
        assert (status, headers["access-control-allow-origin"]) == (200, PAGE)
        assert headers["access-control-allow-credentials"] == "true"
        status, _, body = call(address, "OPTIONS", "/v1/completions", {**PREFLIGHT, "origin": "https://evil.example"})
        assert status == 400 and b"origin" in body.lower()
        status, headers, _ = call(address, "POST", "/v1/completions", {"origin": "https://evil.example"}, COMPLETION)
        assert status == 200 and "access-control-allow-origin" not in headers  # the browser keeps it from the page
    with served(cors=None) as address:
        status, headers, _ = call(address, "POST", "/v1/completions", {"origin": PAGE}, COMPLETION)
        assert status == 200 and "access-control-allow-origin" not in headers


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (openssl, as a deployment would make one)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a test certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


def test_tls_serves_https_that_verifies_and_refuses_plain_http(certificate):
    key, cert = certificate
    with served(tls=TlsFiles(str(key), str(cert))) as address:
        context = ssl.create_default_context(cafile=str(cert))
        status, _, body = call(address, "POST", "/v1/completions", {}, COMPLETION, context=context)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            call(address, "GET", "/health", {})
        with pytest.raises(ssl.SSLCertVerificationError):  # a client that does not trust the certificate
            call(address, "GET", "/health", {}, context=ssl.create_default_context())


def test_the_gateways_flags_build_the_policy_and_refuse_half_a_tls_pair():
    from gateway.main import build_parser, main
    args = build_parser().parse_args(["--allowed-origins", json.dumps([PAGE]), "--allow-credentials"])
    assert (args.allowed_origins, args.allowed_methods, args.allow_credentials) == ([PAGE], ["*"], True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", PAGE])  # not a JSON list
    with pytest.raises(SystemExit):
        main(["--ssl-keyfile", "key.pem"])
