"""Inductor's check of the CPU's vector ISAs, once per machine instead of once per process.

Before inductor compiles or loads CPU code, it checks each vector ISA the CPU reports
(AVX-512, AVX2, ...): it builds a small library for it and loads that in a fresh Python
process, at every start. Where one process of this machine, compiler and torch found every
reported ISA working, the others take that answer (inductor's `cpp.vec_isa_ok`, which its
cache keys hold: set the same way in every process, so they all share one key) and skip
that check; the AVX-512 classes' own checks of their BF16 and VNNI forms still run (three
processes of six on the Zen 4 EPYC). Processes starting together wait for the first one's
check rather than run their own beside it. There a decode service on the bundled model was ready
in 7.0-7.1 s on 7.6-7.9 CPU-s against 8.5-9.4 s on 9.5-10.3 (docs/benchmarks.md, "Inductor's
ISA check once a machine"). Where any ISA failed, each process checks as inductor does.
TORCHINDUCTOR_VEC_ISA_OK, when set, is left to decide.
"""
from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from common.engine.file_lock import exclusive_file_lock
from kernels.cpu.build import compiler_identity, cpu_flags

logger = logging.getLogger(__name__)


def _marker(cache_dir: Path, cxx: str) -> Path:
    """The file that says every ISA this CPU reports passed the check, for this compiler and torch."""
    key = hashlib.sha256("\0".join([compiler_identity(cxx), torch.__version__, str(torch.version.git_version),
                                    cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir / f"vec-isa-ok-{key}"


def check_vec_isas_once(cache_dir: Path, cxx: str) -> bool:
    """Set inductor's vec_isa_ok where this machine's ISAs are known to pass its check (a
    marker under cache_dir), else check them now and leave the marker when all pass.
    Whether this call found the marker and skipped the check. Call before anything compiles
    or loads CPU code."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    if inductor_config.cpp.vec_isa_ok is not None:  # TORCHINDUCTOR_VEC_ISA_OK, or an earlier call here
        return False
    marker = _marker(cache_dir, cxx)
    if marker.exists():
        inductor_config.cpp.vec_isa_ok = True
        return True
    # Processes starting together (a stack's prefill and decode) check once: the others wait
    # for the first's answer (~13 CPU-s of small builds on the 2-core Zen 4 EPYC, which two
    # processes checking at once took from their native builds).
    with exclusive_file_lock(cache_dir / f".{marker.name}.lock",
                             on_wait=lambda: logger.info("waiting for another process's vector ISA check")):
        if marker.exists():
            inductor_config.cpp.vec_isa_ok = True
            return True
        checked = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
        inductor_config.cpp.vec_isa_ok = True
        try:  # the list without the check: every ISA the CPU reports
            reported = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list.__wrapped__()]
        finally:
            inductor_config.cpp.vec_isa_ok = None
        if not checked or checked != reported:
            logger.info("inductor's vector ISA check passed %s of %s: every process checks again", checked, reported)
            return False
        inductor_config.cpp.vec_isa_ok = True  # as in the processes that will find the marker
        fd, tmp = tempfile.mkstemp(prefix=".vec-isa-", dir=cache_dir)
        with os.fdopen(fd, "w") as out:
            out.write("".join(f"{name}\n" for name in checked))  # one ISA a line: a name may hold spaces
        os.replace(tmp, marker)
        return False
