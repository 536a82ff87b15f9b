"""LoadingThreadWatch: a CPU engine stepped on another thread than the one that loaded it,
while that one lives, is told once (common.engine.openmp_teams)."""
from __future__ import annotations

import logging
import os
import threading

import pytest

from common.engine.openmp_teams import LoadingThreadWatch

WARNING = "steps on thread"


def _on_thread(fn, name: str = "engine-loop"):
    box = []
    thread = threading.Thread(target=lambda: box.append(fn()), name=name)
    thread.start()
    thread.join()
    return box[0] if box else None


def _two_threads_two_cpus() -> LoadingThreadWatch:
    return LoadingThreadWatch(num_threads=lambda: 2, num_cpus=lambda: 2)


def test_stepping_on_another_thread_while_the_loader_lives_warns_once(caplog):
    watch = _two_threads_two_cpus()  # loaded here, on the test's thread, which lives on
    with caplog.at_level(logging.WARNING, logger="common.engine.openmp_teams"):
        _on_thread(watch.check)
        _on_thread(watch.check, name="another")
        watch.check()
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == 1 and "'engine-loop'" in warnings[0] and "more than the 2 CPUs" in warnings[0]


@pytest.mark.parametrize("case", ["same thread", "loader ended", "one thread", "teams fit the cpus"])
def test_nothing_is_said_where_libgomp_keeps_spinning(case, caplog):
    if case == "loader ended":
        watch = _on_thread(_two_threads_two_cpus, name="start-up")  # that thread has ended
    elif case == "one thread":
        watch = LoadingThreadWatch(num_threads=lambda: 1, num_cpus=lambda: 2)
    elif case == "teams fit the cpus":
        watch = LoadingThreadWatch(num_threads=lambda: 8, num_cpus=lambda: 16)
    else:
        watch = _two_threads_two_cpus()
    with caplog.at_level(logging.WARNING, logger="common.engine.openmp_teams"):
        if case == "same thread":
            watch.check()
        else:
            _on_thread(watch.check)
    assert not watch.warned and not [r for r in caplog.records if WARNING in r.getMessage()]


def test_an_engine_loaded_on_this_thread_and_stepped_on_another_is_told(tiny_model_factory, caplog):
    import torch

    from common.engine.llm import LLM
    from common.engine.sampling_params import SamplingParams
    if 2 * 2 <= len(os.sched_getaffinity(0)):
        pytest.skip("two teams of two threads fit this host's CPUs: libgomp keeps spinning")
    threads_before = torch.get_num_threads()
    try:
        llm = LLM(model=str(tiny_model_factory("tiny-llama", "llama")), num_kv_blocks=64, block_size=8,
                  enforce_eager=True, num_threads=2)
        params = SamplingParams(max_tokens=2, temperature=0.0)
        with caplog.at_level(logging.WARNING, logger="common.engine.openmp_teams"):
            llm.generate([{"prompt_token_ids": list(range(5, 25))}], params)  # the loading thread: quiet
            assert not [r for r in caplog.records if WARNING in r.getMessage()]
            _on_thread(lambda: llm.generate([{"prompt_token_ids": list(range(5, 25))}], params))
    finally:
        torch.set_num_threads(threads_before)
    assert len([r for r in caplog.records if WARNING in r.getMessage()]) == 1
