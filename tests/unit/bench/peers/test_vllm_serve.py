"""serve-peer's comparison rows: each rate's throughput ratio beside both sides' TPOT and TTFT."""
from __future__ import annotations

import pytest

from bench.peers.vllm_serve import compare


def _run(rate: float, tok_s: float, tpot: float, ttft: float) -> dict:
    return {"request_rate": rate, "output_throughput": tok_s, "p99_tpot_ms": tpot, "mean_ttft_ms": ttft,
            "p99_ttft_ms": 2 * ttft, "failed": 0}


def test_rows_pair_the_runs_rate_by_rate():
    ours = {"runs": [_run(1, 62.0, 20.0, 160.0), _run(4, 231.0, 46.0, 210.0)]}
    peer = {"runs": [_run(1, 60.0, 35.0, 265.0), _run(4, 154.0, 137.0, 648.0)]}
    rows = compare(ours, peer)
    assert [row["request_rate"] for row in rows] == [1, 4]
    assert rows[1]["throughput_ratio"] == pytest.approx(1.5)
    assert (rows[1]["pdserve_p99_tpot_ms"], rows[1]["vllm_p99_tpot_ms"]) == (46.0, 137.0)
    assert (rows[0]["pdserve_mean_ttft_ms"], rows[0]["vllm_mean_ttft_ms"]) == (160.0, 265.0)
    assert (rows[0]["pdserve_p99_ttft_ms"], rows[0]["vllm_p99_ttft_ms"]) == (320.0, 530.0)
