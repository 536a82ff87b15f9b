"""`python -m protos.build [--force]`: generate the gRPC stubs (see protos/_build.py)."""
from protos._build import build, main

__all__ = ["build", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
