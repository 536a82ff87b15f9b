"""The arena cache: a loop that crosses a frame-stack chunk boundary reuses kept chunks
instead of mapping new ones. Each case runs in a fresh interpreter, whose allocator it
changes for good."""
from __future__ import annotations

import json

import pytest

from kernels.cpu.build import find_compiler
from tests.support.fresh_process import run_python


_DIVE_SCRIPT = """
import json, sys
from common.engine.python_arenas import arena_cache_counts, keep_freed_arenas

reasons = [keep_freed_arenas(), keep_freed_arenas()]  # the second finds it in place
before = arena_cache_counts()


def dive(depth):
    # ~400 Python frames (~100 bytes each) span several 16 KiB frame-stack chunks.
    return 0 if depth == 0 else dive(depth - 1) + 1


for _ in range(200):
    assert dive(400) == 400
print(json.dumps({"reasons": reasons, "before": before, "after": arena_cache_counts()}))
"""


def _run(env_overrides: dict[str, str]) -> dict:
    done = run_python(_DIVE_SCRIPT, timeout_s=300, **env_overrides)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(find_compiler() is None, reason="the cache is compiled: needs a C++ compiler")
def test_deep_calls_reuse_kept_chunks_instead_of_mapping_new_ones(tmp_path):
    result = _run({"PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")})
    assert result["reasons"] == [None, None]
    before, after = result["before"], result["after"]
    # 200 dives, each pushing past at least one chunk boundary and popping back: each push
    # is a kept chunk handed out again, and only the first dive's chunks are new.
    assert after["num_reused"] - before["num_reused"] >= 200
    assert after["num_passed_on"] - before["num_passed_on"] <= 8
    assert after["num_released"] == before["num_released"]


def test_turned_off_leaves_the_interpreters_allocator():
    result = _run({"PDSERVE_KEEP_PY_ARENAS": "0"})
    assert result["reasons"] == ["PDSERVE_KEEP_PY_ARENAS=0"] * 2
    assert result["before"] is None and result["after"] is None


def test_without_a_compiler_it_says_why(tmp_path):
    result = _run({"CXX": str(tmp_path / "no-such-compiler"), "PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")})
    assert result["reasons"][0] and "compiler" in result["reasons"][0]
    assert result["after"] is None
