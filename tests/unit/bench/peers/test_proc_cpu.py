"""How the offline bench waits for an engine on the same cores to go quiet: a real child
process that spins until told to stop."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.peers.proc_cpu import tree_cpu_seconds, wait_until_quiet

pytestmark = pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="no /proc here")

# "Not quiet" is judged over one wide window: on a loaded two-core host a spinning child can
# be starved for a 0.2 s window (seen in CI), never for a whole second.
BUSY_WINDOW = {"window_s": 1.0, "max_busy_cores": 0.05}

# Spins until a line arrives on stdin, then waits for EOF without using the CPU.
SPINNER = """
import select, sys
print("spinning", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    pass
sys.stdin.readline()
print("idle", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def spinner():
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "spinning"
    yield child
    child.kill()
    child.wait(timeout=30)


def test_a_spinning_child_is_not_quiet_until_it_stops(spinner):
    cpu_before = tree_cpu_seconds(spinner.pid)
    waited, quiet = wait_until_quiet(spinner.pid, timeout_s=1.0, **BUSY_WINDOW)
    assert not quiet and waited >= 1.0
    assert tree_cpu_seconds(spinner.pid) - cpu_before >= 0.1  # its own time, counted
    spinner.stdin.write("stop\n")
    spinner.stdin.flush()
    assert spinner.stdout.readline().strip() == "idle"
    waited, quiet = wait_until_quiet(spinner.pid, timeout_s=10)
    assert quiet and waited < 10


def test_a_spinning_child_left_out_leaves_its_parent_quiet(spinner):
    # This test's process is the parent: asleep in wait_until_quiet while it measures.
    parent = os.getpid()
    assert wait_until_quiet(parent, exclude_pids=[spinner.pid], timeout_s=10)[1]
    assert not wait_until_quiet(parent, timeout_s=1.0, **BUSY_WINDOW)[1]
    deadline = time.monotonic() + 30
    while tree_cpu_seconds(spinner.pid) < 0.05:
        assert time.monotonic() < deadline, "the spinner never ran"
        time.sleep(0.05)
    # Read in this order, the child's time counted in the whole tree is at least what it
    # had used when read, however the parent's own time grows meanwhile (to a float's
    # rounding: the readings are whole clock ticks).
    without_spinner = tree_cpu_seconds(parent, exclude_pids=[spinner.pid])
    spinner_cpu = tree_cpu_seconds(spinner.pid)
    assert tree_cpu_seconds(parent) - without_spinner >= spinner_cpu - 1e-6


def test_a_process_that_is_gone_uses_nothing():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert tree_cpu_seconds(child.pid) == 0.0
    assert wait_until_quiet(child.pid, timeout_s=1)[1]


# Sleeps a millisecond at a time until stdin closes: an idle engine's polling loop.
WAKER = """
import select, sys
print("waking", flush=True)
while not select.select([sys.stdin], [], [], 0.001)[0]:
    pass
"""


def test_a_polling_child_wakes_hundreds_of_times_a_second_and_a_blocked_one_not_at_all(spinner):
    from bench.peers.proc_cpu import tree_wakeups_per_s
    waker = subprocess.Popen([sys.executable, "-c", WAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert waker.stdout.readline().strip() == "waking"
        assert sum(tree_wakeups_per_s(waker.pid, window_s=0.5).values()) > 100
        spinner.stdin.write("stop\n")
        spinner.stdin.flush()
        assert spinner.stdout.readline().strip() == "idle"  # blocked reading stdin from here on
        assert sum(tree_wakeups_per_s(spinner.pid, window_s=0.5).values()) < 5
    finally:
        waker.kill()
        waker.wait(timeout=30)


def test_host_steal_is_the_eighth_figure_of_proc_stats_cpu_line_in_seconds():
    from bench.peers.proc_cpu import host_steal_seconds
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    line = f"cpu  7046656 251950 513854 3436003 20290 0 12920 {3 * ticks_per_s} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"
    assert host_steal_seconds(line) == 3.0
    assert host_steal_seconds("cpu  10 0 5 100 0 0 0") == 0.0  # a kernel without the field
    with pytest.raises(ValueError, match="first line"):
        host_steal_seconds("intr 12345 0 0")
    before = host_steal_seconds()
    assert 0.0 <= before <= host_steal_seconds()


def test_cpu_and_steal_reads_a_spinning_tree_over_its_block_and_leaves_out_what_is_excluded(spinner):
    from bench.peers.proc_cpu import cpu_and_steal
    parent = os.getpid()
    with cpu_and_steal([spinner.pid]) as spinning, cpu_and_steal([parent], [spinner.pid]) as waiting:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            time.sleep(0.05)
    assert spinning["wall_s"] >= 1.0 and waiting["wall_s"] >= 1.0
    # One spinning thread: up to its block's wall time (less where the host starves it).
    assert 0.1 <= spinning["cpu_s"] <= spinning["wall_s"] + 0.05
    assert waiting["cpu_s"] < 0.1  # this process slept; its spinning child is left out
    assert spinning["steal_s"] >= 0.0 and waiting["steal_s"] >= 0.0
