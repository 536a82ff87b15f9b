"""pdserve's gRPC API. Sources: protos/src/pdserve/v1/*.proto; stubs: protos.pdserve.v1.

Importing this package (re)generates the stubs when missing or stale, so
`from protos.pdserve.v1 import generate_pb2` works on a fresh clone.
"""
from protos._build import ensure_built as _ensure_built

_ensure_built()
