"""`pdserve bench transfer` (bench.transfer.main) runs end to end on tiny requests."""
from __future__ import annotations

import json

import pytest

from bench import transfer as bench

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_bench_writes_every_figure(tmp_path):
    out = tmp_path / "kvbench.json"
    assert bench.main(["--json", str(out), "--tokens", "16,64", "--reps", "1"]) == 0
    res = json.loads(out.read_text())
    assert {(r["transport"], r["tokens"]) for r in res["throughput"]} == {
        ("tcp", 16), ("tcp", 64), ("ipc", 16), ("ipc", 64)}
    for r in res["throughput"]:
        assert r["bytes"] == r["tokens"] * 46_080
        assert r["connector"]["median_gbps"] > 0 and r["pyzmq"]["median_gbps"] > 0 and r["ratio_paired_median"] > 0
    assert len(res["layerwise"]) == 4 and all(r["tail_over_one_layer_paired_median"] > 0 for r in res["layerwise"])
    assert [r["transport"] for r in res["single_block"]] == ["tcp", "ipc"]
    assert set(res["targets"]) == {"throughput_ge_90pct_of_pyzmq_4k_16k", "layerwise_tail_le_one_layer"}
