"""vLLM's environment as the peer benchmarks start it: the KV pool, thread placement and
the libraries its CPU guide preloads (tcmalloc, Intel OpenMP from its venv), found on
disk or left out; and the offline runner (the real script, over a stand-in `vllm`
package, since vLLM is not installed in pdserve's venv) answering one measurement at a
time, failing with its log named and leaving no process behind."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.peers import vllm_peer
from bench.peers.vllm_peer import OfflinePeer, cpu_env, preload_choice, recommended_preload


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


# A stand-in for the `vllm` package (not installed in pdserve's venv), so the real runner
# script runs here: its LLM answers every request with max_tokens tokens, starts a child
# process as vLLM's engine core would (its pid written to a file), logs each generate call
# where asked, and for the tests of failures exits or hangs when the whole workload comes.
STUB_VLLM = '''
import os, subprocess, sys, time
__version__ = "0.0-stub"

class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, logprobs=None):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, n):
        self.token_ids = list(range(n))

class _Output:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class _Embedding:
    def __init__(self, vector):
        self.outputs = type("EmbeddingOutput", (), {"embedding": vector})()

class LLM:
    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        self.engine_core = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                            stdin=subprocess.PIPE)
        with open(os.environ["STUB_ENGINE_CORE_PID_FILE"], "w") as f:
            f.write(str(self.engine_core.pid))

    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("STUB_CALLS_FILE"):  # one line per call, for the tests that count them
            with open(os.environ["STUB_CALLS_FILE"], "a") as f:
                f.write("generate\\n")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(prompts) > 2:  # the whole workload, not the warm-up
            mode = os.environ.get("STUB_MODE", "ok")
            if mode == "exit":
                os._exit(3)
            if mode == "hang":
                while True:
                    time.sleep(1)
        return [_Output(p.max_tokens) for p in params]

    def embed(self, prompts, use_tqdm=True):
        # [prompt length, whether the engine was built as vLLM's pooling runner converts a model,
        #  its pooler config's pooling type: 0 LAST, 1 MEAN, 2 CLS]
        pooling = self.kwargs.get("runner") == "pooling" and self.kwargs.get("convert") == "embed"
        pooling_type = ["LAST", "MEAN", "CLS"].index(self.kwargs["pooler_config"].pooling_type)
        return [_Embedding([float(len(p["prompt_token_ids"])), float(pooling), float(pooling_type)])
                for p in prompts]
'''
# vllm.config, as far as the embed runner reads it.
STUB_VLLM_CONFIG = '''
class PoolerConfig:
    def __init__(self, pooling_type=None):
        self.pooling_type = pooling_type
'''


def _spec(workload) -> dict:
    return {"model_dir": "unused", "dtype": "bfloat16", "seed": 0, "max_model_len": 64, "max_num_seqs": 8,
            "max_num_batched_tokens": 64, "workload": workload, "single_prompt": [5, 6, 7],
            "single_stream_tokens": 9, "ttft_prompt": [1, 2, 3, 4], "repeats": 1}


@pytest.fixture
def stub_vllm(tmp_path, monkeypatch):
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STUB_VLLM)
    (package / "config.py").write_text(STUB_VLLM_CONFIG)
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    pid_file = tmp_path / "engine_core.pid"
    monkeypatch.setenv("STUB_ENGINE_CORE_PID_FILE", str(pid_file))
    return pid_file


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether the process stops running within timeout_s (a zombie left for its dead
    parent's reaper counts as stopped): a signal takes effect a moment after it is sent."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _peer(tmp_path, **kwargs) -> OfflinePeer:
    workload = [[[1, 2, 3], 4], [[4, 5], 6], [[7], 8]]
    return OfflinePeer(Path(sys.executable), _spec(workload), "auto", 1.0, tmp_path / "peer.log", **kwargs)


def test_the_runner_answers_each_measurement_in_turn_and_quits(tmp_path, stub_vllm):
    with _peer(tmp_path, start_timeout_s=60) as peer:
        assert peer.ready == {"ready": True, "vllm_version": "0.0-stub"}
        mixed = peer.call("mixed", timeout_s=60)
        assert mixed["num_output_tokens"] == 4 + 6 + 8 and mixed["seconds"] >= 0
        single = peer.call("single_stream", timeout_s=60)
        assert single["token_ids"] == list(range(9)) and single["tokens_per_s"] > 0
        assert peer.call("memory", timeout_s=60)["num_processes"] == 2  # the runner and its engine core
        with pytest.raises(RuntimeError, match="refused 'warp'.*unknown op"):
            peer.call("warp", timeout_s=60)
        assert peer.call("mixed", timeout_s=60)["num_output_tokens"] == 18  # still serving
        engine_core_pid = int(stub_vllm.read_text())
    assert peer._proc.returncode == 0
    assert _gone(engine_core_pid)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_paused_runner_and_its_engine_core_are_stopped_and_go_on_after(tmp_path, stub_vllm):
    with _peer(tmp_path, start_timeout_s=60) as peer:
        engine_core_pid = int(stub_vllm.read_text())
        with peer.paused():
            # A stop takes effect as each process is next scheduled: wait for it, with a deadline.
            deadline = time.monotonic() + 10
            while {_state(peer.pid), _state(engine_core_pid)} != {"T"}:
                assert time.monotonic() < deadline, "the runner and its engine core never stopped"
                time.sleep(0.01)
        assert peer.call("mixed", timeout_s=60)["num_output_tokens"] == 18  # it goes on


def test_cold_ttft_takes_the_best_of_as_many_runs_as_asked(tmp_path, stub_vllm, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv("STUB_CALLS_FILE", str(calls))
    with _peer(tmp_path, start_timeout_s=60) as peer:
        def generate_calls():
            return len(calls.read_text().splitlines())

        before = generate_calls()
        assert peer.call("cold_ttft", timeout_s=60)["seconds"] >= 0
        assert generate_calls() - before == 3  # the default: best of 3
        before = generate_calls()
        assert peer.call("cold_ttft", timeout_s=60, repeats=1)["seconds"] >= 0
        assert generate_calls() - before == 1  # one run, for runs alternating with pdserve's
        with pytest.raises(RuntimeError, match=r"refused 'memory'.*takes \[\], got \['repeats'\]"):
            peer.call("memory", timeout_s=60, repeats=1)
        assert peer.call("cold_ttft", timeout_s=60, repeats=1)["seconds"] >= 0  # still serving


def test_a_runner_that_dies_names_its_log_and_leaves_no_process(tmp_path, stub_vllm, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "exit")
    with _peer(tmp_path, start_timeout_s=60) as peer:
        engine_core_pid = int(stub_vllm.read_text())
        with pytest.raises(RuntimeError, match=r"exited \(code 3\) during mixed; its log: .*peer\.log"):
            peer.call("mixed", timeout_s=60)
        assert _gone(engine_core_pid)


def test_a_runner_past_its_deadline_is_killed_with_its_engine_core(tmp_path, stub_vllm, monkeypatch):
    monkeypatch.setenv("STUB_MODE", "hang")
    with _peer(tmp_path, start_timeout_s=60) as peer:
        engine_core_pid = int(stub_vllm.read_text())
        with pytest.raises(RuntimeError, match="no answer to mixed within 1 s"):
            peer.call("mixed", timeout_s=1)
        assert peer._proc.returncode == -signal.SIGKILL
        assert _gone(engine_core_pid)


def test_a_runner_that_cannot_start_fails_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nothing-here"))  # no vllm to import
    with pytest.raises(RuntimeError, match=r"exited \(code 1\) during start-up"):
        _peer(tmp_path, start_timeout_s=60)
    assert "No module named 'vllm'" in (tmp_path / "peer.log").read_text()


def test_the_embed_runner_builds_vllms_pooling_runner_and_times_every_prompt(tmp_path, stub_vllm):
    spec = {"model_dir": "unused", "dtype": "bfloat16", "max_model_len": 64, "max_num_seqs": 8,
            "max_num_batched_tokens": 64, "prompts": [[1, 2, 3], [4, 5], [6]], "pooling_type": "MEAN"}
    runner = Path(vllm_peer.__file__).with_name("vllm_embed_runner.py")
    with OfflinePeer(Path(sys.executable), spec, "auto", 1.0, tmp_path / "peer.log", start_timeout_s=60,
                     runner=runner) as peer:
        answer = peer.call("embed", timeout_s=60, num_vectors=2)
        assert answer["vectors"] == [[3.0, 1.0, 1.0], [2.0, 1.0, 1.0]] and answer["seconds"] >= 0
        assert peer.call("embed", timeout_s=60)["vectors"] == []
        with pytest.raises(RuntimeError, match="refused 'mixed'.*unknown op"):
            peer.call("mixed", timeout_s=60)
    assert peer._proc.returncode == 0
