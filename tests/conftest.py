"""Shared fixtures. Kernel tests need TRITON_INTERPRET set before triton is imported."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Before anything imports grpc: the tests fork services (Popen with preexec_fn) from a
# process running gRPC servers, and gRPC's fork handlers abort there (see common/cli/main.py).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# A service or CLI process a test starts that dies of a signal (SIGSEGV, SIGABRT, ...) writes
# every thread's Python stack to its stderr first, so the failing test shows where each was.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# Parity with Hugging Face is checked exactly in fp32; on a CPU with native bf16,
# dtype auto would pick bf16 (tests of `auto` itself pass the CPU flags explicitly).
os.environ.setdefault("PDSERVE_DTYPE", "float32")
# Compiling costs a minute per engine on two cores: engines run eagerly unless a test
# of the compiled path turns it back on.
os.environ.setdefault("PDSERVE_ENFORCE_EAGER", "1")
# Most of the engine services the suite starts (~40 in the services part) never see a
# constraint: building xgrammar's backend at each start cost that part ~37 CPU-seconds
# (~20 s of its wall time).
# Those that test constraints build it on their first (the shared stack warms it, as the
# default does, and test_engine_worker.py checks both).
os.environ.setdefault("PDSERVE_GRAMMAR_WARM_UP", "0")
# The native attention unrolls its loops for every head dim it can and holds every dtype
# pair, whatever models a test process loads: one build of it for the whole suite, every
# path under test (engines otherwise build for their models' head dims and dtypes:
# tests/unit/kernels/test_cpu_attention_head_dims.py).
os.environ.setdefault("PDSERVE_ATTENTION_HEAD_DIMS", "all")
os.environ.setdefault("PDSERVE_ATTENTION_DTYPES", "all")

# On a pytest-xdist worker (scripts/test.sh runs the unit tests on two): one torch thread
# each. Two workers' OpenMP pools of two threads on two cores spin against each other
# (a quantized-model test took 37 s instead of 5). Tests of several threads set them.
ON_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if ON_XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"  # read when torch is imported, below

import pytest  # noqa: E402
import torch  # noqa: E402

if ON_XDIST_WORKER:
    torch.set_num_threads(1)  # in case a plugin imported torch before this file

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    from common.engine.model_files import resolve_model
    return resolve_model()


def make_tiny_model(out_dir: Path, arch: str, tokenizer_dir: Path, **overrides) -> Path:
    """A small random HF checkpoint with the bundled tokenizer (so text prompts work)."""
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.5)
    common.update(overrides)
    if arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def load_cpu_model(model_dir: Path, dtype: torch.dtype = torch.float32, quantization=None) -> torch.nn.Module:
    """A checkpoint's model as the engine loads it on the CPU (no engine around it, nothing packed)."""
    from common.engine.config import ModelConfig
    from common.engine.model_files import load_hf_config
    from common.engine.model_runner import load_model
    return load_model(ModelConfig.from_hf_config(load_hf_config(model_dir)), model_dir, torch.device("cpu"), dtype,
                      quantization)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, bundled_model_dir):
    made: dict[str, Path] = {}

    def factory(name: str, arch: str = "llama", **overrides) -> Path:
        if name not in made:
            made[name] = make_tiny_model(tmp_path_factory.mktemp(name), arch, bundled_model_dir,
                                         **overrides)
        return made[name]
    return factory


@pytest.fixture
def tiny_llama_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("tiny-llama", "llama")


SUITE_PARTS = ("parallel", "services", "serial", "deploy")
UNIT_TESTS = "tests/unit"
DEPLOY_TEST = "tests/integration/test_deploy.py"


def pytest_addoption(parser):
    parser.addoption(
        "--suite-part", choices=SUITE_PARTS, default=None,
        help="scripts/test.sh runs the suite in four parts: 'parallel' is the unit tests that "
             "assert no wall-clock bound and the integration tests marked `in_process` (run "
             "with pytest-xdist's -n 2, a module's `xdist_group` on one worker); 'deploy' the "
             "compose test (its own pytest, beside the parallel part: it waits on containers "
             "with generous deadlines, the other part on nothing); 'services' the other "
             "integration tests (services as processes, waiting on generous deadlines; -n 2 "
             "--dist loadfile, so a module's services are started once); 'serial' the tests "
             "marked `timing` (a wall-clock bound), one at a time, alone. Default: every test.")


def suite_part(item) -> str:
    if item.nodeid.startswith(DEPLOY_TEST):
        return "deploy"
    if item.get_closest_marker("timing") is not None:
        return "serial"
    in_process = item.nodeid.startswith(UNIT_TESTS + "/") or item.get_closest_marker("in_process") is not None
    return "parallel" if in_process else "services"


def shares_module_fixtures(item) -> bool:
    """The test takes a fixture its module's tests share (scope module or class): an engine,
    a stack of services, a plan that took seconds to simulate."""
    fixture_info = getattr(item, "_fixtureinfo", None)  # a test function's; other items have none
    return fixture_info is not None and any(defs[-1].scope in ("module", "class")
                                            for defs in fixture_info.name2fixturedefs.values())


# How a test module marks its timing tests (pytest.mark.timing, on a test or as pytestmark):
# the serial part collects only modules whose source holds it.
TIMING_MARK = "mark.timing"


@functools.lru_cache(maxsize=None)
def declares_timing_tests(path: Path) -> bool:
    return TIMING_MARK in path.read_text(encoding="utf-8", errors="replace")


def pytest_ignore_collect(collection_path, config):
    """The services and deploy parts hold no unit test (suite_part): their processes skip
    importing and collecting tests/unit (~2,100 tests, seconds of each). The serial part
    imports only the modules that mark timing tests (collecting all took ~20 s of one core)."""
    part = config.getoption("--suite-part")
    if part in ("services", "deploy") and collection_path == Path(__file__).parent.parent / UNIT_TESTS:
        return True
    if (part == "serial" and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and not declares_timing_tests(collection_path)):
        return True
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """--suite-part selects its part. Among other tests the compose test runs last: its image
    is prepared in the background meanwhile (tests/support/deploy_image.py, which
    scripts/test.sh starts; mostly downloads and disk writes)."""
    part = config.getoption("--suite-part")
    # The serial part would not collect a timing test its module's source does not mark.
    unseen = sorted({str(item.path) for item in items
                     if suite_part(item) == "serial" and not declares_timing_tests(item.path)})
    if unseen:
        raise pytest.UsageError(f"timing tests marked other than with {TIMING_MARK!r} in their module, which the "
                                f"serial part alone collects: {unseen}")
    if part is not None:
        keep = [item for item in items if suite_part(item) == part]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    # The tests of a module that share its fixtures (its engine, its plan) run on one
    # pytest-xdist worker of --dist loadgroup, which makes those once, while the other runs
    # whatever else is queued.
    for item in items:
        if shares_module_fixtures(item) and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    items.sort(key=lambda item: item.nodeid.startswith(DEPLOY_TEST))


def pytest_configure(config):
    """The services part's processes run on ordinary pages (below). pytest-xdist 3.8's
    --dist loadgroup marks a group by rewriting each grouped test's nodeid, which pytest
    9.2's structured node ids ignore (pytest-xdist#1386): the groups would silently come
    apart, so such a run stops here."""
    if config.getoption("--suite-part") == "services":
        # Its engine processes and workers assert nothing of huge pages (tests/unit does); an
        # engine writing its panels into fresh huge pages took ~0.75 CPU-s more to start (a
        # 1+1 stack 9.2 -> 7.6 CPU-s, the part 264 -> 231 s on the 2-core Zen 4 EPYC, whose
        # VM backs a fresh huge page slowly).
        os.environ.setdefault("PDSERVE_HUGE_PAGES", "0")
    from importlib.metadata import version

    from packaging.version import Version
    if config.getoption("dist", "no") != "loadgroup":
        return
    if Version(pytest.__version__) >= Version("9.2.0.dev0") and Version(version("pytest-xdist")) <= Version("3.8.0"):
        raise pytest.UsageError(f"--dist loadgroup does not group with pytest {pytest.__version__} and "
                                f"pytest-xdist {version('pytest-xdist')} (pytest-xdist#1386); "
                                "see the pytest pin in pyproject.toml")


_prebuild_key = pytest.StashKey[tuple]()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook starts the workers
def pytest_sessionstart(session):
    """On the controller of a pytest-xdist run: tests/support/prebuild.py beside the workers,
    so that where the native libraries or the converted model are missing both cores build
    them rather than one worker while the other waits on their locks."""
    config = session.config
    if ON_XDIST_WORKER or not config.getoption("numprocesses", None):
        return
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen([sys.executable, "-m", "tests.support.prebuild"], cwd=Path(__file__).parent.parent,
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    config.stash[_prebuild_key] = (process, log)


def pytest_terminal_summary(terminalreporter, config):
    """What the prebuild could not build (the tests that need it say why it fails as well).
    A short run on a machine without the libraries waits here for the builds under way: the
    next run loads them, and g++ is not left running behind the run."""
    started = config.stash.get(_prebuild_key, None)
    if started is None:
        return
    from kernels.cpu.build import BUILD_TIMEOUT_S
    process, log = started
    try:
        process.wait(timeout=2 * BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.returncode != 0:
        log.seek(0)
        terminalreporter.write_line(f"tests/support/prebuild.py exited {process.returncode}:\n{log.read()[-3000:]}")
    log.close()
