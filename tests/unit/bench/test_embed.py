"""`pdserve bench embed`'s workload and agreement measure (the runs themselves need the model
and vLLM's venv: the command is a benchmark, not a test)."""
from __future__ import annotations

import pytest

from bench.embed import main, rates, workload


def test_the_workload_is_seeded_and_within_its_bounds():
    prompts = workload(50, 16, 64, 49152, seed=3)
    assert prompts == workload(50, 16, 64, 49152, seed=3) != workload(50, 16, 64, 49152, seed=4)
    assert all(16 <= len(p) <= 64 and all(1000 <= t < 49152 for t in p) for p in prompts)


def test_rates():
    assert rates([2.0, 1.0, 4.0], 10, 100) == {"seconds": [2.0, 1.0, 4.0], "prompts_per_s": 5.0,
                                               "prompt_tokens_per_s": 50.0}


def test_bad_bounds_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--peer", "none", "--min-prompt", "9", "--max-prompt", "8"])
    assert "--min-prompt" in capsys.readouterr().err
