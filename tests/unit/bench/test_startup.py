"""`pdserve bench startup`: its arms and how a failed start is reported."""
from __future__ import annotations

import sys

import pytest

from bench import startup


def test_an_unknown_arm_is_refused(capsys):
    with pytest.raises(SystemExit):
        startup.main(["--arms", "offline,gpu"])
    assert "unknown arm(s) ['gpu']: offline, stack" in capsys.readouterr().err


def test_a_start_that_fails_is_an_error_with_its_output():
    with pytest.raises(RuntimeError, match="no such model"):
        startup.timed_run([sys.executable, "-c", "import sys; sys.exit('no such model')"], env={}, timeout_s=60)


def test_a_start_is_timed_from_launch_to_exit():
    seconds = startup.timed_run([sys.executable, "-c", "import time; time.sleep(0.3)"], env={}, timeout_s=60)
    assert 0.3 <= seconds < 30


def test_a_command_that_times_itself_is_taken_at_its_word():
    seconds = startup.timed_run([sys.executable, "-c", "print('warming up'); print(1.25)"], env={}, timeout_s=60,
                                reports_own_time=True)
    assert seconds == 1.25
