"""The keys a deployment's clients must present (`pdserve gateway --api-key`, or
PDSERVE_API_KEY): `authorization: Bearer <key>` on every GenerateService call and on the
HTTP API's /v1 routes, /tokenize and /detokenize (vLLM guards /v1 the same way). Health,
readiness, /version, the OpenAPI document and the metrics port stay open for probes.

Keys are compared as SHA-256 digests in constant time, each against every key, so neither
a key's length nor which key matched shows in the time an answer takes."""
from __future__ import annotations

import hashlib
import hmac

API_KEY_ENV = "PDSERVE_API_KEY"
# What a refusal says, on gRPC (UNAUTHENTICATED) and HTTP (401).
MISSING_KEY_MESSAGE = ("this gateway needs an API key: send `authorization: Bearer <key>` "
                       "(the key the gateway was started with, --api-key / PDSERVE_API_KEY)")


def parse_api_keys(value: str) -> list[str]:
    """"k1,k2" -> ["k1", "k2"]: several keys, so that one can be rotated out while the
    other still works. "" is no key (compose passes an unset variable as empty); a list of
    only separators is a mistake."""
    keys = [key.strip() for key in value.split(",") if key.strip()]
    if not keys and value.strip():
        raise ValueError("--api-key needs at least one non-empty key")
    return keys


class ApiKeys:
    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def accepts(self, authorization: str | bytes | None) -> bool:
        """Whether an `authorization` header / metadata value carries one of the keys."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, key = (authorization or "").partition(" ")
        digest = hashlib.sha256(key.strip().encode()).digest()
        matched = False
        for expected in self._digests:
            matched |= hmac.compare_digest(digest, expected)
        return matched and scheme.lower() == "bearer"
