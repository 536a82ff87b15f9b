"""bench/cpu_attention.py --pool-pages: the same decode over a pool on 4 KiB pages and on
huge pages, both timed, the figures consistent with each other."""
from __future__ import annotations

import json

import pytest

from bench import cpu_attention
from kernels.cpu_attention import native_attention_error
from kernels.huge_pages import huge_pages_available


needs_pool = pytest.mark.skipif(native_attention_error() is not None or not huge_pages_available(),
                                reason="needs the native CPU attention and transparent huge pages")


def _pool_cases(tmp_path, monkeypatch, *flags: str) -> list[dict]:
    """The cases a pool bench (--pool-pages, --block-order) writes, over 2 layers, 1 thread."""
    monkeypatch.setattr(cpu_attention, "POOL_LAYERS", 2)
    out = tmp_path / "cases.json"
    assert cpu_attention.main([*flags, "--threads", "1", "--seconds", "0.2", "--json", str(out)]) == 0
    return json.loads(out.read_text())["cases"]


@needs_pool
def test_pool_pages_times_both_pools_and_writes_them(tmp_path, monkeypatch):
    cases = _pool_cases(tmp_path, monkeypatch, "--pool-pages", "--dtypes", "bf16")
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


def _runs(row: list[int]) -> list[int]:
    """Lengths of the row's runs of consecutive block ids."""
    lengths = [1]
    for before, block_id in zip(row, row[1:]):
        if block_id == before + 1:
            lengths[-1] += 1
        else:
            lengths.append(1)
    return lengths


def test_block_orders_lay_each_sequence_out_as_named():
    import torch
    gen = torch.Generator().manual_seed(0)
    batch, blocks_per_seq = 4, 20
    tables = {order: cpu_attention.block_order_tables(order, batch, blocks_per_seq, gen).tolist()
              for order in cpu_attention.BLOCK_ORDERS}
    for order, rows in tables.items():
        flat = [block_id for row in rows for block_id in row]
        assert len(set(flat)) == len(flat) and min(flat) >= 0, order  # no block shared
    assert [_runs(row) for row in tables["consecutive"]] == [[20]] * 4
    assert [_runs(row) for row in tables["half_in_runs_of_8"]] == [[10, 8, 2]] * 4
    assert [_runs(row) for row in tables["half_interleaved"]] == [[10] + [1] * 10] * 4
    assert [_runs(row) for row in tables["interleaved"]] == [[1] * 20] * 4
    assert tables["interleaved"][1][:3] == [1, 5, 9]


@needs_pool
def test_block_order_times_every_order(tmp_path, monkeypatch):
    cases = _pool_cases(tmp_path, monkeypatch, "--block-order", "--dtypes", "fp32,bf16")
    assert [(c["batch"], c["context"], c["dtype"]) for c in cases] == [(48, 200, "fp32"), (64, 256, "fp32"),
                                                                       (32, 512, "fp32")]
    for case in cases:
        assert all(case[f"{order}_ms"] > 0 for order in cpu_attention.BLOCK_ORDERS)


def test_paged_cache_lays_each_sequence_in_one_run_where_asked():
    import torch
    gen = torch.Generator().manual_seed(0)
    _, _, consecutive = cpu_attention.paged_cache([40, 70], torch.float32, gen, consecutive=True)
    _, _, shuffled = cpu_attention.paged_cache([40, 70], torch.float32, gen)
    assert consecutive[0, :3].tolist() == [0, 1, 2] and consecutive[1, :5].tolist() == [3, 4, 5, 6, 7]
    assert [_runs(row[:n]) for row, n in zip(shuffled.tolist(), (3, 5))] != [[3], [5]]


@pytest.mark.skipif(native_attention_error() is not None, reason="needs the native CPU attention")
def test_a_prompt_chunk_after_cached_tokens_is_timed_on_the_blocks_asked_for(tmp_path):
    out = tmp_path / "cases.json"
    assert cpu_attention.main(["--prompts", "40", "--prompt-context", "24", "--prompt-blocks", "consecutive",
                               "--dtypes", "fp32", "--threads", "1", "--seconds", "0.05", "--no-build-time",
                               "--json", str(out)]) == 0
    prompt = [c for c in json.loads(out.read_text())["cases"] if c["step"] == "prompt"]
    assert [(c["prompt_tokens"], c["prompt_context"], c["blocks"]) for c in prompt] == [(40, 24, "consecutive")]
    assert 0 < prompt[0]["native_min_ms"] <= prompt[0]["native_ms"]


def test_a_negative_prompt_context_is_refused(capsys):
    with pytest.raises(SystemExit):
        cpu_attention.main(["--prompts", "40", "--prompt-context", "-1"])
    assert "--prompt-context must be at least 0" in capsys.readouterr().err
