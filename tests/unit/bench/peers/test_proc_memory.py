"""What the offline bench reports as each engine's memory: a process tree's proportional set
size, read from /proc, with a real child process holding a known amount."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.peers.proc_memory import tree_memory

pytestmark = pytest.mark.skipif(tree_memory() is None, reason="no /proc/<pid>/smaps_rollup here")

HELD_MIB = 192
# A child that fills HELD_MIB of its own memory (every page written), says so, and waits.
HOLDER = f"import sys; held = b'x' * ({HELD_MIB} << 20); print('ready', flush=True); sys.stdin.read()"


def test_a_childs_memory_counts_in_its_parents_tree():
    before = tree_memory()
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        own = tree_memory(child.pid)
        with_child = tree_memory()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert own["num_processes"] == 1 and HELD_MIB <= own["pss_mib"] < HELD_MIB + 64  # plus an interpreter
    assert with_child["num_processes"] == before["num_processes"] + 1
    assert with_child["pss_mib"] - before["pss_mib"] >= HELD_MIB
    # Gone with the child.
    assert tree_memory()["num_processes"] == before["num_processes"]


def test_an_excluded_child_and_its_own_children_are_left_out():
    before = tree_memory()
    # A holder started by a child, which then waits: a subtree of two processes.
    parent_code = (f"import subprocess, sys; holder = subprocess.Popen([sys.executable, '-c', {HOLDER!r}], "
                   f"stdin=sys.stdin); holder.wait()")
    child = subprocess.Popen([sys.executable, "-c", parent_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with_subtree = tree_memory()
        without_subtree = tree_memory(exclude_pids=[child.pid])
        subtree_itself = tree_memory(child.pid, exclude_pids=[child.pid])  # a root is never left out
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    assert with_subtree["num_processes"] == before["num_processes"] + 2
    assert without_subtree["num_processes"] == before["num_processes"]
    assert with_subtree["pss_mib"] - without_subtree["pss_mib"] >= HELD_MIB
    assert subtree_itself["num_processes"] == 2 and subtree_itself["pss_mib"] >= HELD_MIB


def test_a_process_that_is_gone_has_no_figure():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert tree_memory(child.pid) is None
