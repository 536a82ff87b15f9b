"""common/engine/vec_isa_probe.py: inductor's vector-ISA check runs in the first process of a
machine, compiler and torch; later ones find its marker and skip it."""
from __future__ import annotations

import logging
import platform
import shutil
import threading
import types

import pytest

# compilation before inductor: importing it names inductor's cache directory (pdserve's), which
# inductor fixes the first time one of its modules is imported in the process.
from common.engine import compilation, vec_isa_probe  # noqa: F401
from common.engine.file_lock import exclusive_file_lock
from common.engine.vec_isa_probe import check_vec_isas_once
from tests.support.waiting import wait_for

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None,
                                reason="inductor's x86 ISA check needs an x86 CPU and g++")


@pytest.fixture
def inductor(monkeypatch) -> types.SimpleNamespace:
    """Inductor's config (vec_isa_ok unset, as in a fresh process) and its ISA module."""
    from torch._inductor import config, cpu_vec_isa
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    return types.SimpleNamespace(cpp=config.cpp, isa=cpu_vec_isa)


@pytest.fixture
def cxx() -> str:
    return shutil.which("g++")


def test_the_first_process_checks_and_leaves_a_marker_that_later_ones_take(tmp_path, cxx, inductor, monkeypatch):
    assert not check_vec_isas_once(tmp_path, cxx)  # checked here
    assert inductor.cpp.vec_isa_ok is True  # the key later processes will have too
    [marker] = tmp_path.glob("vec-isa-ok-*")
    assert marker.read_text().splitlines() == [str(isa) for isa in inductor.isa.valid_vec_isa_list()]

    monkeypatch.setattr(inductor.cpp, "vec_isa_ok", None)  # a later process

    def no_check():
        raise AssertionError("the ISAs were checked where the marker said every one passes")

    monkeypatch.setattr(inductor.isa, "valid_vec_isa_list", no_check)
    assert check_vec_isas_once(tmp_path, cxx)
    assert inductor.cpp.vec_isa_ok is True  # inductor takes every reported ISA, unchecked


def test_a_process_starting_beside_the_checking_one_waits_for_its_marker(tmp_path, cxx, inductor, monkeypatch,
                                                                        caplog):
    marker = vec_isa_probe._marker(tmp_path, cxx)
    reported = [str(isa) for isa in inductor.isa.valid_vec_isa_list.__wrapped__()]

    def no_check():
        raise AssertionError("checked again beside the process that was checking")

    monkeypatch.setattr(inductor.isa, "valid_vec_isa_list", no_check)
    results = []
    with caplog.at_level(logging.INFO, logger="common.engine.vec_isa_probe"):
        with exclusive_file_lock(tmp_path / f".{marker.name}.lock"):  # another process checking
            # (inductor's config is the thread's own: read it there)
            later = threading.Thread(target=lambda: results.append((check_vec_isas_once(tmp_path, cxx),
                                                                    inductor.cpp.vec_isa_ok)), daemon=True)
            later.start()
            wait_for(lambda: any("waiting for another process's vector ISA check" in r.message
                                 for r in caplog.records), 30, "the later process to wait for the check")
            marker.write_text("".join(f"{isa}\n" for isa in reported))  # its answer
        later.join(timeout=30)
    assert results == [(True, True)]  # took the first one's answer: inductor skips its check


def test_an_isa_that_fails_the_check_leaves_no_marker_and_every_process_checks(tmp_path, cxx, inductor,
                                                                                monkeypatch):
    reported = inductor.isa.valid_vec_isa_list.__wrapped__
    one_failing = lambda: reported()[1:]  # noqa: E731
    one_failing.__wrapped__ = reported
    monkeypatch.setattr(inductor.isa, "valid_vec_isa_list", one_failing)
    assert not check_vec_isas_once(tmp_path, cxx)
    assert not list(tmp_path.glob("vec-isa-ok-*"))
    assert inductor.cpp.vec_isa_ok is None  # inductor checks as it would


def test_another_compiler_checks_again(tmp_path, cxx, inductor, monkeypatch):
    check_vec_isas_once(tmp_path, cxx)
    monkeypatch.setattr(inductor.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(vec_isa_probe, "compiler_identity", lambda cxx: "/usr/bin/g++-99 1 1")
    assert not check_vec_isas_once(tmp_path, cxx)
    assert len(list(tmp_path.glob("vec-isa-ok-*"))) == 2


def test_the_environment_variable_decides_where_set(tmp_path, cxx, inductor, monkeypatch):
    monkeypatch.setattr(inductor.cpp, "vec_isa_ok", False)  # TORCHINDUCTOR_VEC_ISA_OK=0
    assert not check_vec_isas_once(tmp_path, cxx)
    assert inductor.cpp.vec_isa_ok is False and not list(tmp_path.glob("vec-isa-ok-*"))


def test_the_key_holds_the_compiler_torch_and_cpu(monkeypatch, tmp_path, cxx):
    first = vec_isa_probe._marker(tmp_path, cxx)
    markers = {first}
    with monkeypatch.context() as m:
        m.setattr(vec_isa_probe, "compiler_identity", lambda cxx: "/usr/bin/g++-99 1 1")
        markers.add(vec_isa_probe._marker(tmp_path, cxx))
    with monkeypatch.context() as m:
        m.setattr(vec_isa_probe.torch, "__version__", "0.0.1+elsewhere")
        markers.add(vec_isa_probe._marker(tmp_path, cxx))
    with monkeypatch.context() as m:
        m.setattr(vec_isa_probe, "cpu_flags", lambda: "flags : sse2")
        markers.add(vec_isa_probe._marker(tmp_path, cxx))
    assert len(markers) == 4  # each of the three changes the key
    assert vec_isa_probe._marker(tmp_path, cxx) == first
