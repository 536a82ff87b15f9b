"""Methods compiled ahead of time: saved, loaded by a later process, compiled again when stale."""
from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from common.engine.file_lock import exclusive_file_lock
from common.engine.models.prepacked_linear import PrepackedLinear
from common.engine.precompiled import STALE_ARTIFACT_AGE_S, PrecompiledMethod, remove_stale_artifacts
from kernels.cpu_linear import panels_for_any_rows

REPO_ROOT = Path(__file__).resolve().parents[4]

_TOY_MODULE = """
import torch

SCALE = {scale}


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(12.0).reshape(3, 4) - 5, requires_grad=False)

    def forward(self, x):
        return torch.relu(x @ self.weight.T) * SCALE
"""

# Runs the toy's forward through a PrecompiledMethod in a fresh process (as a restart would).
_RUN_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from common.engine.precompiled import STALE_ARTIFACT_AGE_S, PrecompiledMethod, remove_stale_artifacts
from toy_model import Toy
toy = Toy()
method = PrecompiledMethod(toy, "forward", Path(sys.argv[1]), fallback=lambda: toy.forward)
x = torch.arange(8.0).reshape(2, 4)
print(json.dumps({"output": method(x).tolist(), "how": method.source}))
"""


class Toy(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = torch.nn.Parameter((torch.arange(12.0).reshape(3, 4) - 5).to(dtype), requires_grad=False)

    def forward(self, x):
        return torch.relu(x @ self.weight.T) + 1


class BreaksTheGraph(Toy):
    def forward(self, x):
        y = x @ self.weight.T
        torch._dynamo.graph_break()  # one whole graph is impossible
        return y + 1


def _run_toys(module_dir: Path, cache_dir: Path, num_processes: int, **env_overrides: str) -> list[dict]:
    """What num_processes fresh processes, started together, report (as restarts would)."""
    # No bytecode cache: an edited toy module must be compiled from its new source.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(module_dir), str(REPO_ROOT)]), PYTHONDONTWRITEBYTECODE="1",
               **env_overrides)
    processes = [subprocess.Popen([sys.executable, "-c", _RUN_SCRIPT, str(cache_dir)], env=env, cwd=REPO_ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(num_processes)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_processes_compile_once_load_the_file_and_compile_again_after_a_source_change(tmp_path):
    module_dir, cache_dir = tmp_path / "src", tmp_path / "cache"
    module_dir.mkdir()
    (module_dir / "toy_model.py").write_text(_TOY_MODULE.format(scale=2.0))
    x = torch.arange(8.0).reshape(2, 4)
    weight = torch.arange(12.0).reshape(3, 4) - 5
    # Started together: one compiles and saves, the other waits for it (the lock) and loads.
    together = _run_toys(module_dir, cache_dir, 2)
    assert sorted(r["how"] for r in together) == ["compiled", "loaded"]
    for result in together:
        assert result["output"] == (torch.relu(x @ weight.T) * 2.0).tolist()
    assert len(list(cache_dir.glob("*.bin"))) == 1
    # The constant was traced into the saved code: a new value must not be served the old one.
    (module_dir / "toy_model.py").write_text(_TOY_MODULE.format(scale=3.0))
    [changed] = _run_toys(module_dir, cache_dir, 1)
    assert changed["how"] == "compiled"
    assert changed["output"] == (torch.relu(x @ weight.T) * 3.0).tolist()


def test_code_saved_at_one_cpu_capability_is_not_loaded_at_another(tmp_path):
    # ATEN_CPU_CAPABILITY=default holds torch (and inductor's vectors) below what any x86
    # CPU has: the code saved at the machine's own capability must not serve it.
    module_dir, cache_dir = tmp_path / "src", tmp_path / "cache"
    module_dir.mkdir()
    (module_dir / "toy_model.py").write_text(_TOY_MODULE.format(scale=2.0))
    assert [r["how"] for r in _run_toys(module_dir, cache_dir, 1)] == ["compiled"]
    held = _run_toys(module_dir, cache_dir, 1, ATEN_CPU_CAPABILITY="default")
    assert [r["how"] for r in held] == ["compiled"]
    assert [r["how"] for r in _run_toys(module_dir, cache_dir, 1)] == ["loaded"]
    assert len(list(cache_dir.glob("*.bin"))) == 2


def _first_call(model: Toy, cache_dir: Path, caplog) -> tuple[PrecompiledMethod, list[str]]:
    """A PrecompiledMethod of model's forward after one call (checked against eager), and the
    warnings that call logged."""
    method = PrecompiledMethod(model, "forward", cache_dir, fallback=lambda: model.forward)
    x = torch.arange(8.0).reshape(2, 4)
    with caplog.at_level(logging.WARNING, logger="common.engine.precompiled"):
        assert torch.equal(method(x), model(x))
    return method, [r.message for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_saved_file_is_loaded_while_another_process_holds_the_lock(tmp_path, caplog):
    """Services starting together on a warm cache load side by side: a saved file is whole
    (renamed into place), so the lock, held by whoever compiles, is not waited for."""
    toy = Toy()
    _first_call(toy, tmp_path, caplog)  # compiles and saves
    method = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward)
    x = torch.arange(8.0).reshape(2, 4)
    results = []
    with exclusive_file_lock(method.artifact_path.with_suffix(".lock")):  # another open file: as another process
        caller = threading.Thread(target=lambda: results.append(method(x)), daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert results, "the load waited for the lock"
    assert method.source == "loaded" and torch.equal(results[0], toy(x))


def test_a_refused_file_is_compiled_under_the_lock_and_read_once(tmp_path, caplog):
    toy = Toy()
    path = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward).artifact_path
    path.write_bytes(b"not a compiled function")
    method, warnings = _first_call(toy, tmp_path, caplog)
    assert method.source == "compiled"
    assert sum("cannot load the compiled Toy.forward" in m for m in warnings) == 1


def test_an_unreadable_file_is_compiled_again_and_replaced(tmp_path, caplog):
    toy = Toy()
    PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward).artifact_path.write_bytes(
        b"not a compiled function")
    method, warnings = _first_call(toy, tmp_path, caplog)
    assert method.source == "compiled"
    assert any("cannot load the compiled Toy.forward" in m for m in warnings)
    reloaded, _ = _first_call(toy, tmp_path, caplog)
    assert reloaded.source == "loaded"


def test_a_method_that_cannot_be_compiled_whole_falls_back_with_a_warning(tmp_path, caplog):
    method, warnings = _first_call(BreaksTheGraph(), tmp_path, caplog)
    assert method.source == "fallback"
    assert any("cannot compile BreaksTheGraph.forward ahead of time" in m for m in warnings)
    assert list(tmp_path.glob("*.bin")) == []


def test_the_file_is_named_by_what_the_code_was_compiled_for(tmp_path):
    def path_of(model: torch.nn.Module) -> Path:
        return PrecompiledMethod(model, "forward", tmp_path, fallback=lambda: model.forward).artifact_path

    assert path_of(Toy()) == path_of(Toy())
    assert path_of(Toy()) != path_of(Toy(torch.bfloat16))
    assert path_of(Toy()) != path_of(BreaksTheGraph())
    num_threads = torch.get_num_threads()
    before = path_of(Toy())
    torch.set_num_threads(num_threads + 1)  # inductor's C++ is generated for the thread count
    try:
        assert path_of(Toy()) != before
    finally:
        torch.set_num_threads(num_threads)


@pytest.mark.skipif(not panels_for_any_rows(), reason="single weight copies need bf16 panels for every step")
def test_a_packed_linear_s_kernels_are_not_in_the_name_its_weight_id_is(tmp_path):
    """A decode instance holding single weight copies loads what a prefill instance holding
    two compiled: the graph calls the same op with the same weight ids, whose kernels the
    native table picks at run time."""
    def packed(single_copy: bool) -> torch.nn.Sequential:
        weight = torch.randn(64, 32, dtype=torch.bfloat16)
        return torch.nn.Sequential(PrepackedLinear(weight, None, single_copy=single_copy))

    def path_of(model: torch.nn.Module) -> Path:
        return PrecompiledMethod(model, "forward", tmp_path, fallback=lambda: model.forward).artifact_path

    gc.collect()  # earlier tests' packed weights free their table slots
    two_copies = packed(single_copy=False)
    two_copies_path, two_copies_repr = path_of(two_copies), repr(two_copies)
    held = packed(single_copy=False)  # beside it: the next slot, another constant in the graph
    assert held[0].weight_id != two_copies[0].weight_id and path_of(held) != two_copies_path
    del two_copies, held
    gc.collect()
    single = packed(single_copy=True)  # the slot the first had, as in another process
    assert single[0].single_copy and repr(single) != two_copies_repr  # the kernels differ
    assert path_of(single) == two_copies_path


@pytest.mark.parametrize("num_rows", [1, 5])
def test_rows_other_than_the_first_calls_are_served_when_marked_unbacked(tmp_path, num_rows):
    # The engine marks the token dimension unbacked at the first call: the saved code holds
    # no size, so any number of rows runs it (nothing would check a size at call time).
    toy = Toy()
    method = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward)
    first = torch.arange(8.0).reshape(2, 4)
    torch._dynamo.decorators.mark_unbacked(first, 0)
    assert torch.equal(method(first), toy(first))
    other = torch.arange(4.0 * num_rows).reshape(num_rows, 4)
    assert torch.equal(method(other), toy(other))


def test_a_call_in_another_form_than_the_first_is_refused(tmp_path):
    toy = Toy()
    method = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward)
    x = torch.arange(8.0).reshape(2, 4)
    method(x)
    with pytest.raises(TypeError,
                       match=r"compiled for 1 positional arguments and keywords \[\]; called with 0 and \['x'\]"):
        method(x=x)
    assert torch.equal(method(x), toy(x))


class ScaledToy(Toy):
    def forward(self, x, scale):
        return torch.relu(x @ self.weight.T) * scale


def test_a_call_with_tensors_or_values_unlike_the_first_is_refused(tmp_path):
    # The saved code checks no size or stride (inductor's asserts are off) and was traced
    # for the first call's dtypes and constants: the method refuses what would differ.
    toy = ScaledToy()
    method = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward)
    x = torch.arange(8.0).reshape(2, 4)
    assert torch.equal(method(x, 2), toy(x, 2))
    with pytest.raises(TypeError, match=r"a 2-d torch.float32 tensor as argument leaf 0; "
                                        r"called with a 2-d torch.float64 tensor"):
        method(x.double(), 2)
    with pytest.raises(TypeError, match=r"called with a 2-d non-contiguous torch.float32 tensor"):
        method(torch.arange(8.0).reshape(4, 2).t(), 2)
    with pytest.raises(TypeError, match=r"a 2-d torch.float32 tensor as argument leaf 0; called with a 1-d"):
        method(torch.arange(4.0), 2)
    with pytest.raises(TypeError, match=r"2 as argument leaf 1; called with 3"):  # a constant in the code
        method(x, 3)
    other = torch.arange(12.0).reshape(3, 4)  # other sizes are what the code is for
    assert torch.equal(method(other, 2), toy(other, 2))


def test_a_cache_directory_that_cannot_be_written_leaves_the_method_compiled_in_memory(tmp_path, caplog):
    not_a_directory = tmp_path / "taken"
    not_a_directory.write_text("a file where the cache directory should be")
    method, warnings = _first_call(Toy(), not_a_directory, caplog)
    assert method.source == "compiled"
    assert any("cannot save the compiled Toy.forward" in m for m in warnings)


def _age(path: Path, seconds: float) -> None:
    old = path.stat().st_mtime - seconds
    os.utime(path, (old, old))


def test_saving_removes_the_method_files_left_unused_and_loading_keeps_a_file_in_use(tmp_path, caplog):
    stale = tmp_path / "Toy.forward-0123456789abcdef01234567.bin"  # another key, e.g. an older torch
    stale.write_bytes(b"old")
    stale.with_suffix(".lock").touch()
    in_use = tmp_path / "Toy.forward-76543210fedcba9876543210.bin"  # another thread count, loaded lately
    in_use.write_bytes(b"recent")
    other_method = tmp_path / "Toy.compute_logits-0123456789abcdef01234567.bin"
    other_method.write_bytes(b"old")
    for path in (stale, stale.with_suffix(".lock"), other_method):
        _age(path, STALE_ARTIFACT_AGE_S + 3600)
    _age(in_use, STALE_ARTIFACT_AGE_S - 3600)
    toy = Toy()
    method = PrecompiledMethod(toy, "forward", tmp_path, fallback=lambda: toy.forward)
    x = torch.arange(8.0).reshape(2, 4)
    with caplog.at_level(logging.INFO, logger="common.engine.precompiled"):
        assert torch.equal(method(x), toy(x))
    assert method.source == "compiled"
    assert not stale.exists() and not stale.with_suffix(".lock").exists()
    assert in_use.exists() and other_method.exists()
    assert any("removed 1 compiled Toy.forward file(s) unused for 14 days" in r.message for r in caplog.records)
    # A load marks its file used, so a later save of another key keeps it.
    _age(method.artifact_path, STALE_ARTIFACT_AGE_S + 3600)
    reloaded, _ = _first_call(Toy(), tmp_path, caplog)
    assert reloaded.source == "loaded"
    assert remove_stale_artifacts(tmp_path, "Toy.forward", keep=in_use) == []
    assert reloaded.artifact_path.exists()


def test_stale_files_go_by_their_age_only(tmp_path):
    keep, young, old = (tmp_path / f"M.forward-{key}.bin" for key in ("a", "b", "c"))
    for path in (keep, young, old):
        path.write_bytes(b"x")
    now = keep.stat().st_mtime
    _age(keep, 10 * STALE_ARTIFACT_AGE_S)
    _age(old, 2 * 86400)
    assert remove_stale_artifacts(tmp_path, "M.forward", keep=keep, max_age_s=86400, now=now) == [old]
    assert keep.exists() and young.exists()
