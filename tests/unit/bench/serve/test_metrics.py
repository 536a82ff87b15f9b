"""bench.serve.metrics against figures computed by hand (vLLM's definitions)."""
from __future__ import annotations

import pytest

from bench.serve.metrics import RequestOutcome, compute_metrics, format_report, parse_goodput


def outcomes() -> list[RequestOutcome]:
    return [
        # 4 tokens: TTFT 100 ms, E2EL 300 ms, ITL 50/100/50 ms, TPOT (300-100)/3 ms
        RequestOutcome(10, start_s=0.0, chunk_offsets_s=[0.1, 0.15, 0.25, 0.3], chunk_tokens=[1, 1, 1, 1]),
        # 3 tokens in 2 chunks: TTFT 200, E2EL 500, ITL 300, TPOT (500-200)/2 = 150
        RequestOutcome(20, start_s=0.5, chunk_offsets_s=[0.2, 0.5], chunk_tokens=[1, 2]),
        # 1 token: TTFT = E2EL = 50, no ITL, no TPOT
        RequestOutcome(30, start_s=1.0, chunk_offsets_s=[0.05], chunk_tokens=[1]),
        RequestOutcome(100, start_s=1.2, error="UNAVAILABLE: no decode instance"),
        RequestOutcome(100, start_s=1.3),  # ended cleanly without a token: failed, as in vLLM
    ]


def test_counts_and_throughputs():
    m = compute_metrics(outcomes(), duration_s=2.0)
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["total_input_tokens"] == 60  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 8
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)
    assert m["request_goodput"] is None  # no SLO given
    # 1-second buckets: [0,1) holds 4 tokens of the first request + 1 of the second
    assert m["max_output_tokens_per_s"] == 5.0
    assert m["max_concurrent_requests"] == 2
    assert m["errors"][3] == "UNAVAILABLE: no decode instance"
    assert m["output_lens"] == [4, 3, 1, 0, 0]


def test_ttft_e2el_and_percentiles():
    m = compute_metrics(outcomes(), duration_s=2.0, percentiles=[50, 90, 99])
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["std_ttft_ms"] == pytest.approx(62.3610, abs=1e-3)  # population std of 100, 200, 50
    # numpy linear interpolation over sorted [50, 100, 200]: rank 0.9*2 = 1.8 -> 100 + 0.8*100
    assert m["p90_ttft_ms"] == pytest.approx(180)
    assert m["p99_ttft_ms"] == pytest.approx(198)
    assert m["p50_ttft_ms"] == m["median_ttft_ms"]
    assert m["mean_e2el_ms"] == pytest.approx(850 / 3)
    assert m["median_e2el_ms"] == pytest.approx(300)


def test_tpot_excludes_first_token_and_single_token_requests():
    m = compute_metrics(outcomes(), duration_s=2.0)
    tpots = [200 / 3, 150]
    assert m["mean_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    assert m["median_tpot_ms"] == pytest.approx(sum(tpots) / 2)
    assert m["tpots"][2] is None


def test_itl_is_pooled_over_requests():
    m = compute_metrics(outcomes(), duration_s=2.0)
    assert m["itls"][:3] == [pytest.approx([0.05, 0.1, 0.05]), pytest.approx([0.3]), []]
    assert m["mean_itl_ms"] == pytest.approx((50 + 100 + 50 + 300) / 4)
    assert m["median_itl_ms"] == pytest.approx(75)


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 150, "tpot": 100}, 2),  # 2nd fails TTFT; the 1-token request counts TPOT as 0
    ({"ttft": 150, "tpot": 100, "e2el": 200}, 1),  # the 1st now fails E2EL
    ({"tpot": 100}, 2),  # 2nd fails TPOT (150)
    ({"tpot": 150}, 3),  # limits are inclusive
    ({"e2el": 10}, 0),
])
def test_goodput_requires_every_slo(slos, good):
    m = compute_metrics(outcomes(), duration_s=2.0, slos_ms=slos)
    assert m["request_goodput"] == pytest.approx(good / 2.0)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(["ttft:1,e2el:2"]) == {"ttft": 1.0, "e2el": 2.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_no_samples_reported_as_none_and_report_prints():
    m = compute_metrics([RequestOutcome(5, error="INTERNAL: boom")], duration_s=1.0, slos_ms={"ttft": 1})
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["request_goodput"] == 0.0
    text = format_report(m, [99])
    assert "Failed requests:" in text and "Mean TTFT (ms):" in text and "n/a" in text
    text = format_report(compute_metrics(outcomes(), 2.0, {"ttft": 150}, [90, 99]), [90, 99])
    assert "Request goodput (req/s):" in text and "P90 ITL (ms):" in text
