"""Reasoning split from the answer, whole and streamed in any split (a property test: what
streams out equals what the whole answer gives), for both template conventions."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai_api.reasoning_parsers import make_reasoning_parser

R1 = make_reasoning_parser("deepseek_r1")
QWEN3 = make_reasoning_parser("qwen3")


@pytest.mark.parametrize("text, r1, qwen3", [
    ("<think>\nSum it.\n</think>\n\nIt is 4.", ("\nSum it.\n", "\n\nIt is 4."), ("\nSum it.\n", "\n\nIt is 4.")),
    # the template opened <think>: R1's answer starts inside it; Qwen3's then has no reasoning
    ("Sum it.</think>It is 4.", ("Sum it.", "It is 4."), (None, "Sum it.</think>It is 4.")),
    ("It is 4.", ("It is 4.", None), (None, "It is 4.")),
    # cut short while thinking: all reasoning
    ("<think>Let me see", ("Let me see", None), ("Let me see", None)),
    ("  <think>a</think>", ("a", None), ("a", None)),
    ("", ("", None), (None, "")),
])
def test_whole_answers(text, r1, qwen3):
    assert R1.split(text) == r1
    assert QWEN3.split(text) == qwen3


ANSWERS = st.sampled_from([
    "<think>\nSum it.\n</think>\n\nIt is 4.", "Sum it.</think>It is 4.", "It is 4.", "<think>Let me see",
    "  <think>a</think>b", "", " ", "<thi", "<think></think>", "a </think", "x<think>y</think>z",
    "<think>a</thin>b</think>c", "<", "\n\n<think>\nhm\n</think>"])


@settings(max_examples=400, deadline=None)
@given(answer=ANSWERS, cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=10),
       name=st.sampled_from(["deepseek_r1", "qwen3"]))
def test_any_split_streams_what_the_whole_answer_gives(answer, cuts, name):
    parser = make_reasoning_parser(name)
    points = sorted({min(c, len(answer)) for c in cuts})
    pieces = [answer[a:b] for a, b in zip([0, *points], [*points, len(answer)])]
    stream = parser.stream()
    reasoning, content = "", ""
    for piece in pieces:
        r, c = stream.feed(piece)
        reasoning, content = reasoning + r, content + c
        assert "</think>" not in reasoning  # the end marker never leaks out as reasoning
    r, c = stream.finish()
    expected_reasoning, expected_content = parser.split(answer)
    assert (reasoning + r, content + c) == (expected_reasoning or "", expected_content or "")
