"""Python scripts run in a new interpreter: for what a process decides once (a native
library's build target, AMX tiles, what start-up loads), which other tests in this process
may already have decided."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO_ROOT


def run_python(script: str, *args: str, timeout_s: int, unset: tuple[str, ...] = (),
               cgroup: Path | None = None, **environment: str) -> subprocess.CompletedProcess:
    """Run script with args from the repository's root (first on PYTHONPATH), these variables
    set and those in unset removed, in the cgroup directory `cgroup` if one is given; expect
    it to exit 0, and return what it printed."""
    env = {name: value for name, value in os.environ.items() if name not in unset}
    # The parent's own entries stay after the root: a machine that installs the dependencies
    # into a directory of their own (scripts/gpu_check.sh) finds them there.
    inherited = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    env.update(environment, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), *inherited]))
    join_cgroup = None if cgroup is None else (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s, preexec_fn=join_cgroup)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def run_python_ok(script: str, *args: str, timeout_s: int, **environment: str) -> None:
    """run_python, expecting the script to print ok."""
    done = run_python(script, *args, timeout_s=timeout_s, **environment)
    assert "ok" in done.stdout, done.stdout + done.stderr
