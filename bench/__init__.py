"""Benchmarks: `pdserve bench <command>` runs bench/<command>.py (bench/serve/ for `serve`).

Each writes its figures as JSON (`--json FILE`) for docs/benchmarks.md; none runs in the
test suite. bench/fakes/ holds the stand-ins some of them (and the tests) run against.
"""
