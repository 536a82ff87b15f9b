"""The compiled model path: same tokens as eager, no recompiles after warm-up, the fallbacks."""
from __future__ import annotations

import gc
import json
import logging
import os

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics

from common.engine import compilation
from common.engine.compilation import num_compiled_graphs
from common.engine.llm import LLM
from common.engine.models.prepacked_linear import PrepackedLinear
from common.engine.sampling_params import SamplingParams
from kernels.cpu_decode import native_decode_available
from kernels.cpu_linear import panels_for_any_rows
from tests.conftest import load_cpu_model
from tests.support.fresh_process import run_python
from tests.unit.common.engine.models.family_parity import save_tiny_model

# Compiled and eager differ only in summation order (fused kernels): fp32 logprobs agree
# to this, and greedy tokens exactly on these prompts.
LOGPROB_ATOL = 1e-4
# In bf16 each linear's output is rounded to bf16; panel_gemm and oneDNN may sum in
# different orders (on the Zen 4 EPYC the tiny model's logprobs came out identical).
BF16_LOGPROB_ATOL = 0.05


@pytest.fixture(scope="module")
def engines(tiny_model_factory, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    # A cache of this module's own, which the compiled engine below fills (the restart test reads it).
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    model_dir = tiny_model_factory("tiny-llama", "llama")
    # A small token budget makes long prompts chunk: steps mix prefill chunks and decodes.
    options = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory="64MiB")
    gc.collect()  # packed weights of earlier tests' models free their table slots
    layers_before = _layer_compile_counts()
    compiled = LLM(str(model_dir), **options)
    compiled.graphs_after_warm_up = num_compiled_graphs()
    compiled.layer_compile_counts = [after - before for after, before in zip(_layer_compile_counts(), layers_before)]
    compiled.cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    compiled.model_dir = model_dir
    eager = LLM(str(model_dir), enforce_eager=True, **options)
    mp.undo()
    yield compiled, eager
    compiled.engine.shutdown()
    eager.engine.shutdown()


def _layer_compile_counts() -> list[int]:
    """How many times dynamo has traced a nested compile region (a decoder layer) and how
    many times it has reused one traced before, in this process."""
    metrics = compilation_time_metrics
    return [len(metrics.get("invoke_subgraph_trace", ())), len(metrics.get("invoke_subgraph_reuse_stamp_out", ()))]


def _prompts(lengths: list[int]) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 13 * n) % 900 + 50 for i in range(n)]} for n in lengths]


def _assert_same_greedy(got, want, atol: float) -> None:
    """The same tokens, each with the same logprob within atol."""
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_step.token_logprob == pytest.approx(w_step.token_logprob, abs=atol)


@pytest.mark.parametrize("native_decode", [False, True], ids=["compiled-decode", "native-decode"])
def test_compiled_and_eager_agree_on_prefill_decode_and_mixed_steps(engines, native_decode):
    compiled, eager = engines
    runner = compiled.engine.executor.runner
    loop = runner.native_decode
    if native_decode and loop is None:
        pytest.skip("no native decode loop here (no native GEMV or attention)")
    # Decode-only steps of up to 4 tokens go to the native loop where the engine built one.
    runner.native_decode = loop if native_decode else None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    # One prompt alone (prefill-only, then decode-only steps), then a batch whose long
    # prompts chunk while the short ones decode (mixed steps).
    try:
        outputs = [(compiled.generate(prompts, params), eager.generate(prompts, params))
                   for prompts in (_prompts([9]), _prompts([3, 150, 40, 97, 1]))]
    finally:
        runner.native_decode = loop
    for got, want in outputs:
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert g_step.top_token_ids == w_step.top_token_ids
                assert g_step.top_logprobs == pytest.approx(w_step.top_logprobs, abs=LOGPROB_ATOL)
                assert g_step.token_logprob == pytest.approx(w_step.token_logprob, abs=LOGPROB_ATOL)


def test_no_recompiles_after_warm_up_over_many_batch_sizes(engines):
    compiled, _ = engines
    runner = compiled.engine.executor.runner
    # On CPU the methods were compiled ahead of time (not the per-start fallback): one
    # piece of code whatever the number of tokens, which dynamo never sees again.
    assert (runner.forward.source, runner.compute_logits.source) in {("compiled", "compiled"), ("loaded", "loaded")}
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for num_prompts in (1, 2, 3, 5, 8, 13):
        compiled.generate(_prompts([1 + 11 * i for i in range(num_prompts)]), params)
    # Counted from the end of warm-up: the first request must not compile either.
    assert num_compiled_graphs() == compiled.graphs_after_warm_up


def test_one_decoder_layer_is_compiled_for_all(engines):
    compiled, _ = engines
    runner = compiled.engine.executor.runner
    assert runner.forward.source == "compiled"  # this module's cache started empty
    num_layers = len(runner.model.layers)
    assert num_layers >= 2
    # Traced once, reused for every other layer but the last, which goes on with the kept rows
    # alone and is compiled inline (the tokens equal eager's: the test above).
    assert compiled.layer_compile_counts == [1, num_layers - 2]


def test_layers_that_differ_get_their_own_compiled_layer(tmp_path, bundled_model_dir, monkeypatch):
    # Gemma 2's even layers see a sliding window (an int of the layer, so a constant of its
    # compiled code) and its odd layers do not: each kind needs its own compiled layer.
    from transformers import Gemma2Config, Gemma2ForCausalLM
    model_dir = save_tiny_model(tmp_path / "gemma2", Gemma2Config, Gemma2ForCausalLM, bundled_model_dir,
                                head_dim=16, query_pre_attn_scalar=24, sliding_window=8, pad_token_id=0,
                                initializer_range=0.1, tie_word_embeddings=False, num_hidden_layers=4)
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    options = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory="16MiB")
    gc.collect()
    before = _layer_compile_counts()
    compiled = LLM(str(model_dir), **options)
    eager = LLM(str(model_dir), enforce_eager=True, **options)
    try:
        # Layers 0 and 2 share one, layer 1 has its own; the last (3) is compiled inline.
        assert [after - b for after, b in zip(_layer_compile_counts(), before)] == [2, 1]
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        prompts = _prompts([5, 30, 70])  # mostly longer than the window
        assert ([o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
                == [o.outputs[0].token_ids for o in eager.generate(prompts, params)])
    finally:
        compiled.engine.shutdown()
        eager.engine.shutdown()


def test_a_second_model_of_the_same_class_runs_its_own_graphs(engines, tiny_model_factory, monkeypatch):
    # The compiled methods keep no guards on the model's attributes (common.engine.precompiled);
    # a model of the same class and shapes but other weights must still not be handed the first
    # model's compiled code, which holds that model's weight ids. Both are checked against eager runs.
    compiled, eager = engines
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled.cache_dir)
    other_dir = tiny_model_factory("tiny-llama-other-weights", "llama", initializer_range=0.3)
    options = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory="64MiB")
    other = LLM(str(other_dir), **options)
    other_eager = LLM(str(other_dir), enforce_eager=True, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = _prompts([9, 40])
        first = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
        second = [o.outputs[0].token_ids for o in other.generate(prompts, params)]
        assert second == [o.outputs[0].token_ids for o in other_eager.generate(prompts, params)]
        assert first == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        assert first != second  # the two models do differ
        assert first == [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    finally:
        other.engine.shutdown()
        other_eager.engine.shutdown()


def test_enforce_eager_runs_the_model_itself(engines):
    _, eager = engines
    runner = eager.engine.executor.runner
    assert runner.forward is runner.model
    assert runner.native_decode is None
    # Eager turns compiling off, not the CPU's packed linears.
    assert isinstance(runner.model.layers[0].self_attn.qkv_proj, PrepackedLinear)
    assert runner.model.prepacked_head is not None


@pytest.mark.parametrize("switch, single_rank, packed", [(None, True, True), ("0", True, False), (None, False, False)],
                         ids=["packed", "switched-off", "a-parallel-rank"])
def test_an_eager_model_keeps_packed_linears_unless_switched_off_or_a_rank(tiny_llama_dir, monkeypatch, switch,
                                                                           single_rank, packed):
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", "1")
    if switch is None:
        monkeypatch.delenv("PDSERVE_PREPACK_LINEARS", raising=False)
    else:
        monkeypatch.setenv("PDSERVE_PREPACK_LINEARS", switch)
    model = load_cpu_model(tiny_llama_dir)
    forward = compilation.compile_forward(model, torch.device("cpu"), enforce_eager=False, single_rank=single_rank)
    assert forward is model
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PrepackedLinear))]
    assert linears and all(isinstance(m, PrepackedLinear) == packed for m in linears)
    assert (model.prepacked_head is not None) == packed


def test_packed_and_torchs_linears_give_an_eager_engine_the_same_tokens(tiny_llama_dir, monkeypatch):
    """The packed linears differ from torch's in summation order only (fp32)."""
    options = dict(dtype="float32", enforce_eager=True, max_num_batched_tokens=64, kv_cache_memory="32MiB")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = _prompts([5, 30, 70])
    outputs = []
    for switch in ("1", "0"):
        monkeypatch.setenv("PDSERVE_PREPACK_LINEARS", switch)
        llm = LLM(str(tiny_llama_dir), **options)
        qkv_proj = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv_proj, PrepackedLinear) == (switch == "1")
        outputs.append([o.outputs[0] for o in llm.generate(prompts, params)])
        llm.engine.shutdown()
    packed, plain = outputs
    assert [o.token_ids for o in packed] == [o.token_ids for o in plain]
    for p, q in zip(packed, plain):
        torch.testing.assert_close(torch.tensor([s.token_logprob for s in p.logprobs]),
                                   torch.tensor([s.token_logprob for s in q.logprobs]), atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")
def test_a_compiled_cpu_engine_takes_decode_steps_to_the_native_loop(engines):
    compiled, _ = engines
    loop = compiled.engine.executor.runner.native_decode
    assert loop is not None
    steps_before = loop.num_steps
    compiled.generate(_prompts([9]), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert loop.num_steps == steps_before + 4  # the prefill step samples the first token


def test_without_a_compiler_the_model_runs_eagerly_with_one_log_line(tiny_llama_dir, monkeypatch, caplog):
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setattr(compilation, "find_cpp_compiler", lambda: None)
    model = load_cpu_model(tiny_llama_dir)
    with caplog.at_level(logging.WARNING, logger="common.engine.compilation"):
        assert compilation.compile_forward(model, torch.device("cpu"), enforce_eager=False) is model
    assert [r.message for r in caplog.records if "no C++ compiler" in r.message] != []
    # oneDNN packs the linears without a compiler.
    assert isinstance(model.layers[0].self_attn.qkv_proj, PrepackedLinear)


def test_the_per_start_fallback_compiles_the_layers_apart(tiny_llama_dir, monkeypatch, tmp_path):
    # The per-start compile traces every size dynamic, where dynamo cannot reuse a layer.
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled_methods = []
    monkeypatch.setattr(compilation, "_compile_method", compiled_methods.append)
    model = load_cpu_model(tiny_llama_dir)
    forward = compilation.compile_forward(model, torch.device("cpu"), enforce_eager=False)
    assert model.compile_layer_once
    forward.fallback()
    assert not model.compile_layer_once and compiled_methods == [model.forward]


def test_environment_can_force_eager(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_ENFORCE_EAGER", "1")
    model = load_cpu_model(tiny_llama_dir)
    assert compilation.compile_forward(model, torch.device("cpu"), enforce_eager=False) is model


def test_compiled_code_goes_to_the_pdserve_cache_unless_told_otherwise(tmp_path):
    """Inductor puts its own default into the environment when its modules are first
    imported; the engine's modules must have put pdserve's there before."""
    script = ("import common.engine.model_runner\n"
              "import torch._inductor.config\n"
              "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
              "print(cache_dir())")
    done = run_python(script, timeout_s=120, unset=("TORCHINDUCTOR_CACHE_DIR",), XDG_CACHE_HOME=str(tmp_path))
    assert done.stdout.strip() == str(tmp_path / "pdserve" / "inductor")
    # A directory the user names wins.
    done = run_python(script, timeout_s=120, XDG_CACHE_HOME=str(tmp_path),
                      TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "mine"))
    assert done.stdout.strip() == str(tmp_path / "mine")


# Builds the same compiled engine in a fresh process (KV pool size and block size as given),
# and prints where its compiled methods came from, what dynamo and inductor did, and its
# greedy tokens for the prompts given as JSON.
_RESTART_SCRIPT = """
import json, sys
from torch._dynamo.utils import counters
from common.engine.llm import LLM
from common.engine.sampling_params import SamplingParams
from kernels.cpu_decode import native_decode_available
from kernels.cpu_linear import panels_for_any_rows
llm = LLM(sys.argv[1], dtype="float32", max_num_batched_tokens=64, kv_cache_memory=sys.argv[2],
          block_size=int(sys.argv[3]))
runner = llm.engine.executor.runner
sources = {"forward": runner.forward.source, "compute_logits": runner.compute_logits.source}
outputs = llm.generate(json.loads(sys.argv[4]), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print(json.dumps({**sources, "token_ids": [o.outputs[0].token_ids for o in outputs],
                  **{k: dict(counters[k]) for k in ("inductor", "stats")}}))
"""


# The saved code holds no size of the KV pool: another pool and block size load it too.
@pytest.mark.parametrize("kv_cache_memory,block_size", [("64MiB", 16), ("24MiB", 32)])
def test_a_restart_loads_the_compiled_methods_without_tracing(engines, kv_cache_memory, block_size):
    compiled, eager = engines
    runner = compiled.engine.executor.runner
    assert (runner.forward.source, runner.compute_logits.source) in {("compiled", "compiled"), ("loaded", "loaded")}
    # The graphs name packed weights by table slot: a restart matches the saved file only if
    # this process numbered them from 0 too (no packed model of an earlier test alive).
    assert min(m.weight_id for m in runner.model.modules() if isinstance(m, PrepackedLinear)) == 0
    prompts = _prompts([9, 70])
    # Inductor's CPU code is generated for the thread count, which is part of the file's key
    # (an earlier test of this process may have changed it).
    done = run_python(_RESTART_SCRIPT, str(compiled.model_dir), kv_cache_memory, str(block_size), json.dumps(prompts),
                      timeout_s=300, unset=("PDSERVE_ENFORCE_EAGER",), TORCHINDUCTOR_CACHE_DIR=compiled.cache_dir,
                      OMP_NUM_THREADS=str(torch.get_num_threads()))
    warm = json.loads(done.stdout.strip().splitlines()[-1])
    assert (warm["forward"], warm["compute_logits"]) == ("loaded", "loaded")
    # Nothing traced, nothing compiled.
    assert warm["stats"].get("unique_graphs", 0) == 0
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0
    want = eager.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert warm["token_ids"] == [o.outputs[0].token_ids for o in want]


@pytest.mark.skipif(not panels_for_any_rows(), reason="panel_gemm does not serve every step here (no AVX512-BF16, "
                                                      "or AMX)")
def test_a_single_weight_copy_engine_runs_every_step_on_the_panels(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    options = dict(dtype="bfloat16", max_num_batched_tokens=256, kv_cache_memory="64MiB")
    single = LLM(str(tiny_llama_dir), single_weight_copy=True, **options)
    two_copies = LLM(str(tiny_llama_dir), **options)
    try:
        linears = {name: [m for m in llm.engine.executor.runner.model.modules() if isinstance(m, PrepackedLinear)]
                   for name, llm in (("single", single), ("two", two_copies))}
        # Every projection and the head: their panels alone, no oneDNN copy; oneDNN's beside
        # the panels without the flag.
        assert len(linears["single"]) == 4 * single.engine.model_config.num_hidden_layers + 1
        assert all(m.single_copy and m._packed is None and m._panels is not None for m in linears["single"])
        assert not any(m.single_copy for m in linears["two"])
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
        # A 200-token prompt's prefill (200 rows: oneDNN's beside the panels, panel_gemm's
        # alone), then decode steps; and a batch whose long prompt chunks beside short ones' decodes.
        for prompts in (_prompts([200]), _prompts([3, 230, 40])):
            _assert_same_greedy(single.generate(prompts, params), two_copies.generate(prompts, params),
                                BF16_LOGPROB_ATOL)
    finally:
        single.engine.shutdown()
        two_copies.engine.shutdown()


def test_a_pool_of_fp8_codes_runs_the_compiled_methods_as_the_eager_model(engines, monkeypatch):
    """kv_cache_dtype fp8: the compiled methods (loaded from the fp32 pool's engine: the pool
    is no part of their key) write and read the codes as the eager model does. After the
    recompile count's test: its engine compiles graphs, which that count would see."""
    compiled, _ = engines
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled.cache_dir)
    options = dict(dtype="float32", max_num_batched_tokens=64, kv_cache_memory="16MiB", kv_cache_dtype="fp8")
    fp8_compiled = LLM(str(compiled.model_dir), **options)
    fp8_eager = LLM(str(compiled.model_dir), enforce_eager=True, **options)
    try:
        runner = fp8_compiled.engine.executor.runner
        assert runner.forward is not runner.model and runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        prompts = _prompts([3, 150, 40, 9])  # chunked prompts beside decodes, then decode-only steps
        _assert_same_greedy(fp8_compiled.generate(prompts, params), fp8_eager.generate(prompts, params), LOGPROB_ATOL)
    finally:
        fp8_compiled.engine.shutdown()
        fp8_eager.engine.shutdown()


@pytest.mark.skipif(not native_decode_available(), reason="no native GEMV or attention here")
def test_warm_up_gives_the_proposer_its_own_native_loop(engines, monkeypatch):
    """A compiled engine's warm-up builds an early-exit proposer's loop (the target's first
    layer) beside its own; the drafts run there, and the tokens are those of the compiled
    engine without speculation. After the recompile count's test, as the fp8 one: its
    engine loads this module's compiled methods."""
    compiled, _ = engines
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", compiled.cache_dir)
    speculative = dict(method="early_exit", num_speculative_tokens=3, num_early_exit_layers=1,
                       disable_by_batch_size=None, min_acceptance_rate=0.0)
    llm = LLM(str(compiled.model_dir), dtype="float32", max_num_batched_tokens=64, kv_cache_memory="16MiB",
              speculative_config=speculative)
    try:
        runner = llm.engine.executor.runner
        draft_loop = runner.proposer.loop
        assert runner.native_decode is not None and draft_loop is not None and len(draft_loop.k_caches) == 1
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        prompts = _prompts([3, 40, 9])
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
        assert draft_loop.num_steps >= 3 and llm.engine.stats()["spec_num_draft_tokens"] > 0
    finally:
        llm.engine.shutdown()


# Compiles the tiny model at one thread with two for the steps that prefill, in a fresh
# process, and prints every OpenMP pragma of the C++ that inductor generated for it.
_PRAGMAS_SCRIPT = """
import json, os, pathlib, sys
from common.engine.llm import LLM
llm = LLM(sys.argv[1], dtype="float32", num_threads=1, num_prefill_threads=2, kv_cache_memory="16MiB")
sources = [p.read_text() for p in pathlib.Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.py")]
print(json.dumps([line.strip() for text in sources if "cpp_fused" in text
                  for line in text.splitlines() if line.strip().startswith("#pragma omp parallel")]))
"""


def test_kernels_compiled_at_one_thread_run_the_prefill_steps_on_their_threads(tiny_llama_dir, tmp_path):
    """A decode instance at one thread prefills on --num-prefill-threads: inductor's fused
    kernels must open OpenMP regions that take the step's thread count, not be serial code
    (what inductor writes for one thread) nor pinned with num_threads(N)."""
    done = run_python(_PRAGMAS_SCRIPT, str(tiny_llama_dir), timeout_s=300, unset=("PDSERVE_ENFORCE_EAGER",),
                      TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    pragmas = json.loads(done.stdout.strip().splitlines()[-1])
    assert pragmas, "inductor's kernels open no OpenMP region: they run serially on every step"
    assert all(pragma == "#pragma omp parallel" for pragma in pragmas), pragmas
