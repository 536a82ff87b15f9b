"""bench offline's check that both engines computed the model (how many greedy tokens of
the single stream they agree on before they first differ), and its step times."""
from __future__ import annotations

from bench.offline import StepTimes, num_leading_equal
from common.engine.outputs import ScheduledRequest, SchedulerOutput
from common.engine.sampling_params import SamplingParams


def test_tokens_agree_up_to_the_first_difference():
    assert num_leading_equal([5, 6, 7, 8], [5, 6, 9, 8]) == 2
    assert num_leading_equal([5, 6, 7], [5, 6, 7]) == 3
    assert num_leading_equal([5, 6], [5, 6, 7]) == 2  # the shorter one agrees throughout


def test_an_engine_computing_garbage_agrees_on_none():
    assert num_leading_equal([0] * 16, [339, 3826, 346]) == 0
    assert num_leading_equal([], [1]) == 0


def _step(*num_tokens: int) -> SchedulerOutput:
    scheduled = [ScheduledRequest(f"r{i}", list(range(n)), 0, [0], True, SamplingParams())
                 for i, n in enumerate(num_tokens)]
    return SchedulerOutput(scheduled, sum(num_tokens))


def test_step_times_count_a_step_as_decode_only_when_each_request_computes_one_token():
    times = StepTimes()
    times(_step(1, 1, 1), 0.010)
    times(_step(1, 40, 1), 0.200)  # a prompt chunk among decode tokens
    times(_step(1), 0.005)
    times(_step(512), 0.300)
    assert times.as_dict() == {"decode_seconds": 0.015, "num_decode_steps": 2,
                               "other_seconds": 0.5, "num_other_steps": 2}
