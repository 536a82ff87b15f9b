"""pdserve's gRPC API. Sources: protos/src/pdserve/v1/*.proto; stubs: protos.pdserve.v1.

Importing this package (re)generates the stubs when missing or stale, so
`from protos.pdserve.v1 import generate_pb2` works on a fresh clone. An installed copy
without the .proto sources (a wheel, a non-editable install) has nothing to build from:
it uses the stubs it was installed with.
"""
from protos._build import OUT_DIR as _OUT_DIR
from protos._build import ensure_built as _ensure_built
from protos._build import proto_files as _proto_files

if _proto_files():
    _ensure_built()
elif not (_OUT_DIR / "v1" / "generate_pb2.py").exists():
    raise ImportError(f"pdserve's gRPC stubs are missing from {_OUT_DIR / 'v1'} and there are no .proto "
                      "sources to generate them from; reinstall pdserve from a tree where "
                      "`python -m protos.build` has run")
