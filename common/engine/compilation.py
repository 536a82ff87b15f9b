"""The compiled model path: torch.compile (inductor) around the model's forward pass.

Attention is the split point (an opaque custom op, common.engine.models.attention),
so inductor fuses everything between attentions — norms, RoPE, SiLU, residuals. On
CPU the linears are packed once for oneDNN before compiling (models.prepacked_linear,
which uses AMX / AVX512-BF16 for bf16) and reached through a custom op, so the graphs
hold no weights: inductor's freezing, which would pack them instead, embeds mkldnn
constants its caches cannot store, and every start would recompile. (An eager
single-rank CPU model keeps the packed linears too: _pack_eager.) The token
dimension is unbacked (ModelRunner.warm_up): one forward graph and one logits graph
serve every batch, one token included, so a run of varied batches does not recompile.
On CPU the forward and the logits are compiled ahead of time and saved whole under the
pdserve cache directory (common.engine.precompiled): a restart loads them without
tracing (2-4 s for SmolLM2 on the 2-core Zen 3 EPYC, where tracing again took 9-12 s),
and the first start compiles one decoder layer for all of them (CausalLM.compile_layer_once).
On CUDA, and where that compile fails, inductor's FX-graph and AOT-autograd caches on
disk spare a restart the compiling, but dynamo traces the model again at each start.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import types
from pathlib import Path
from typing import Callable

import torch

from common.engine.models.prepacked_linear import PrepackedLinear, prepack_linears
from common.engine.precompiled import PrecompiledMethod
from common.engine.vec_isa_probe import check_vec_isas_once
from kernels._backend import switched_off
from kernels.cpu_attention import cpu_attention_backend
from kernels.cpu_decode import native_decode_available, native_decode_disabled
from kernels.cpu_sampling import native_argmax_available

logger = logging.getLogger(__name__)


def compile_cache_dir() -> Path:
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "inductor"


# Inductor sets TORCHINDUCTOR_CACHE_DIR to its own default (/tmp/torchinductor_<user>) the
# first time one of its modules is imported, and reads it from then on: ours must be in
# the environment before that, or the compiled code goes to /tmp (gone with a reboot) while
# the log names the pdserve cache.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))


def find_cpp_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would use, or None when the machine has none."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def num_compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def compile_forward(model: torch.nn.Module, device: torch.device, enforce_eager: bool,
                    single_weight_copy: bool = False, dynamic_threads: bool = False,
                    single_rank: bool = True) -> Callable:
    """The model's forward, compiled; the model itself where compiling is off or impossible.
    single_weight_copy: the prepacked linears keep their weights once where they can
    (PrepackedLinear's single_copy). dynamic_threads: some steps run on another thread count
    than the process's (--num-prefill-threads). single_rank: the model is not one rank's
    share of a parallel run (whose linears stay torch's, as prepack_linears requires).

    PDSERVE_ENFORCE_EAGER=1 in the environment turns compiling off like --enforce-eager
    (it sets that flag for the services)."""
    if enforce_eager or os.environ.get("PDSERVE_ENFORCE_EAGER", "").lower() in ("1", "true", "yes", "on"):
        logger.info("model runs eagerly (--enforce-eager%s)", _pack_eager(model, single_rank, single_weight_copy))
        return model
    cxx = find_cpp_compiler()
    if device.type == "cpu" and cxx is None:
        logger.warning("no C++ compiler found (g++, c++, clang++ or $CXX): the model runs eagerly%s; "
                       "install one to compile it", _pack_eager(model, single_rank, single_weight_copy))
        return model
    cache_dir = compile_cache_dir()  # in the environment since this module was imported
    cache_dir.mkdir(parents=True, exist_ok=True)
    import torch._inductor.config as inductor_config
    if device.type == "cpu":
        # A cold start builds four native libraries: the GEMV that packing the linears loads
        # (~14 s of g++ on the 2-core Zen 4 EPYC), attention (~14 s, two g++ side by side), the
        # sampler (~7 s) and the decode loop (~20 s) that warm-up loads. g++ runs the GEMV on
        # this thread, the other three on their own, one after another, from before inductor's
        # ISA check (a machine's first start: ~13 s of small builds one at a time) while the
        # model is packed and dynamo traces (the graph holds the Python op pdserve::paged_attention,
        # whose first run waits for the library): the main thread never waits on a build that
        # another core could have run meanwhile. A cold start to its first token there: 48.5 s
        # in this order, 63.6 s with the builds after the ISA check and the loop's first.
        # The attention choice raises again, where it is made, if PDSERVE_CPU_ATTENTION is wrong.
        threading.Thread(target=_build_native_kernels, name="build-kernels", daemon=True).start()
        check_vec_isas_once(cache_dir, shutil.which(cxx))

    inductor_config.fx_graph_cache = True
    # A float traced as a symbol (the RMSNorm eps, the attention scale) made dynamo
    # restart its whole trace once the compiler turned it back into a constant.
    torch._dynamo.config.specialize_float = True
    torch._dynamo.config.run_gc_after_compile = False  # ~0.5 s per graph; the engine allocates little
    # Inductor writes its CPU kernels for the thread count at compile time: serial code at one
    # thread, `num_threads(N)` at any count but the machine's. A decode instance at one thread
    # runs its prefill steps on --num-prefill-threads, so there its norms, RoPE and SiLU must
    # take the step's count: OpenMP regions that run on the threads torch has when they start.
    # Only there: with one thread a core, the dynamic form made the offline mixed workload
    # ~7% slower on the model-167 Xeon.
    inductor_config.cpp.dynamic_threads = dynamic_threads
    num_prepacked = prepack_linears(model, single_copy=single_weight_copy)
    num_single = sum(1 for m in model.modules() if isinstance(m, PrepackedLinear) and m.single_copy)
    single = f", {num_single} of them kept once, in panel_gemm's panels (--single-weight-copy)" if num_single else ""
    logger.info("model compiled with torch.compile (inductor; %d linears prepacked%s; cache %s)",
                num_prepacked, single, cache_dir)
    if device.type == "cpu":
        # One decoder layer compiled for all (~20 s less for SmolLM2 on two cores).
        model.compile_layer_once = True

        def fallback() -> Callable:
            model.compile_layer_once = False  # the per-start compile traces all dims dynamic
            return _compile_method(model.forward)
        return PrecompiledMethod(model, "forward", cache_dir / "precompiled", fallback=fallback)
    return _compile_method(model.forward)


def _pack_eager(model: torch.nn.Module, single_rank: bool, single_weight_copy: bool) -> str:
    """Pack an eager CPU model's linears as a compiled one's are: eager turns off compiling,
    not the CPU's matmul kernels (vLLM's CPU backend keeps its oneDNN GEMMs in eager mode
    too). Torch's own fp32 linears made SmolLM2's one-token decode steps ~2.8x slower on the
    2-core Zen 4 EPYC (72 against 26 ms a token at one thread); packing costs a start ~1.4
    CPU-seconds. PDSERVE_PREPACK_LINEARS=0 keeps torch's linears (a reference for the packed
    ones). What the log line adds."""
    num_prepacked = pack_eager_linears(model, single_weight_copy) if single_rank else 0
    return f"; {num_prepacked} linears prepacked" if num_prepacked else ""


def pack_eager_linears(model: torch.nn.Module, single_weight_copy: bool = False) -> int:
    """prepack_linears for a model that runs eagerly on one rank (an eager engine's, or a
    draft model's, which runs eagerly in every mode), unless PDSERVE_PREPACK_LINEARS=0.
    How many were packed."""
    if switched_off("PDSERVE_PREPACK_LINEARS"):
        return 0
    return prepack_linears(model, single_copy=single_weight_copy)


def _compile_method(method: Callable) -> Callable:
    """torch.compile of a model's bound method, without dynamo's guards on the model.

    Before each call dynamo checks its guards, and for this model ~3,400 of them (~0.35 ms
    per compiled region, ~5% of a one-token step) are on the model's own attributes: the
    modules' types and dicts, their ints (each linear's weight_id) and parameters. A loaded
    model never changes them, so they are dropped (the guards on the call's arguments, on
    globals and on torch's state stay). What makes that safe is the method's own code
    object: dynamo keeps compiled graphs on the code object, and with the class's shared
    code another model of the same class would be offered this model's graphs with
    nothing left to tell them apart (the graphs hold this model's weight ids)."""
    func = method.__func__
    own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__ = func.__kwdefaults__
    return torch.compile(types.MethodType(own, method.__self__), dynamic=True, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


def _build_native_kernels() -> None:
    try:
        cpu_attention_backend()
    except (ValueError, RuntimeError):
        pass
    # The sampler before the decode loop: the loop's build waits for the GEMV's (it loads it),
    # which packing the linears builds on the main thread; the sampler's needs nothing.
    native_argmax_available()
    if not native_decode_disabled():
        native_decode_available()


def compile_logits(model: torch.nn.Module, forward: Callable) -> Callable:
    """model.compute_logits, compiled alongside a compiled forward (its own graph: it runs on
    the sampled rows only). compile_forward has packed the LM head's weight like the other
    linears, which matters most where it is tied to the embedding: unpacked it is a plain
    GEMV over the whole vocabulary (~40% slower on CPU for SmolLM2's 49k x 576 bf16)."""
    if forward is model:  # eager
        return model.compute_logits
    if isinstance(forward, PrecompiledMethod):
        return PrecompiledMethod(model, "compute_logits", forward.cache_dir,
                                 fallback=lambda: _compile_method(model.compute_logits))
    return _compile_method(model.compute_logits)
