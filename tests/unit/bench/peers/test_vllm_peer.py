"""vLLM's environment as the peer benchmarks start it: the KV pool, thread placement and
the libraries its CPU guide preloads (tcmalloc, Intel OpenMP from its venv), found on
disk or left out; nothing of vLLM is imported or run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.peers import vllm_peer
from bench.peers.vllm_peer import cpu_env, preload_choice, recommended_preload


@pytest.fixture
def venv_python(tmp_path: Path) -> Path:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    return python


def test_the_guides_libraries_are_preloaded_where_found(tmp_path, venv_python, monkeypatch):
    lib_dir = tmp_path / "usr-lib"
    lib_dir.mkdir()
    (lib_dir / "libtcmalloc_minimal.so.4").touch()
    iomp = venv_python.parent.parent / "lib" / "libiomp5.so"
    iomp.parent.mkdir()
    iomp.touch()
    monkeypatch.setattr(vllm_peer, "_TCMALLOC_DIRS", (str(tmp_path / "elsewhere"), str(lib_dir)))
    assert recommended_preload(venv_python) == [str(lib_dir / "libtcmalloc_minimal.so.4"), str(iomp)]
    assert preload_choice("auto", venv_python) == recommended_preload(venv_python)
    assert preload_choice("none", venv_python) == []


def test_nothing_found_nothing_preloaded(tmp_path, venv_python, monkeypatch):
    monkeypatch.setattr(vllm_peer, "_TCMALLOC_DIRS", (str(tmp_path / "empty"),))
    assert recommended_preload(venv_python) == []


def test_the_full_tcmalloc_stands_in_for_the_minimal_one(tmp_path, venv_python, monkeypatch):
    (tmp_path / "libtcmalloc.so.4").touch()
    monkeypatch.setattr(vllm_peer, "_TCMALLOC_DIRS", (str(tmp_path),))
    assert recommended_preload(venv_python) == [str(tmp_path / "libtcmalloc.so.4")]


def test_env_puts_the_preload_ahead_of_what_was_set(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/opt/already.so")
    env = cpu_env("all", 2.0, ["/lib/a.so", "/lib/b.so"])
    assert env["LD_PRELOAD"] == "/lib/a.so:/lib/b.so:/opt/already.so"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{len(os.sched_getaffinity(0)) - 1}"
    assert os.environ["LD_PRELOAD"] == "/opt/already.so"  # ours is left alone


def test_env_without_a_preload_leaves_ld_preload_as_it_was(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env = cpu_env("auto", 1.0)
    assert "LD_PRELOAD" not in env
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in env
