"""bench/cpu_attention.py --pool-pages: the same decode over a pool on 4 KiB pages and on
huge pages, both timed, the figures consistent with each other."""
from __future__ import annotations

import json

import pytest

from bench import cpu_attention
from kernels.cpu_attention import native_attention_error
from kernels.huge_pages import huge_pages_available


@pytest.mark.skipif(native_attention_error() is not None or not huge_pages_available(),
                    reason="needs the native CPU attention and transparent huge pages")
def test_pool_pages_times_both_pools_and_writes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_attention, "POOL_LAYERS", 2)
    out = tmp_path / "pool.json"
    assert cpu_attention.main(["--pool-pages", "--threads", "1", "--dtypes", "bf16", "--seconds", "0.2",
                               "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["cases"]
    assert [(c["batch"], c["context"]) for c in cases] == [(64, 128), (64, 256), (32, 512)]
    for case in cases:
        assert case["step"] == "decode_pool" and case["layers"] == 2 and case["reps"] == 5
        for pages in ("small_pages", "huge_pages"):
            assert 0 < case[f"{pages}_min_ms"] <= case[f"{pages}_ms"]
        assert case["speedup"] == pytest.approx(case["small_pages_ms"] / case["huge_pages_ms"], abs=0.01)


def test_pool_pages_refuses_without_huge_pages(monkeypatch, capsys):
    monkeypatch.setattr(cpu_attention, "huge_pages_available", lambda: False)
    if native_attention_error() is not None:
        pytest.skip("needs the native CPU attention")
    assert cpu_attention.main(["--pool-pages", "--no-build-time"]) == 1
    assert "no transparent huge pages" in capsys.readouterr().err
