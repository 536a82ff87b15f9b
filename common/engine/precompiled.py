"""A model method compiled ahead of time and kept whole on disk, so a restart does not trace.

torch.compile with inductor caches the generated code on disk, but every new process
still has dynamo trace the model again to find which cached code it needs, and build
guards for it: for SmolLM2's 30 layers that is 9-12 s of each start on a 2-core CPU.
Dynamo's ahead-of-time compile (`torch.compile(...).aot_compile`) instead saves the
traced bytecode and inductor's code in one file, which a later process loads in 2-4 s
without tracing.

That file carries no guards (they would be on the model's modules and classes, which it
cannot serialize), so nothing at call time checks that it still fits. The file name
says what it was compiled for instead (_artifact_key: the model's structure, config,
dtypes and packed-weight ids, the kernels chosen at trace time, the thread count, the
CPU and the capability torch and inductor use it at, torch and Python), and after
loading, the source of every module the trace went through must be what it was then,
or the method is compiled again. The calls must also
keep the form of the first one, which each call checks (_ArgumentForm: the number of
arguments and the keywords; each tensor's dtype, number of dimensions and contiguity;
each plain value, which the code holds as a constant); every token count is served, as
the first call marks the token dimension unbacked, and every other size of an argument
is a symbol of its own (a KV pool of another size or block size loads the same file).
The model's own tensors (weights) keep static sizes: those are in the file's key, and
dynamo's reuse of one compiled decoder layer for all (CausalLM.compile_layer_once)
fails where they are symbols.

Inductor's own checks of every input's sizes and strides are left out of the code
(size_asserts off, as vLLM's CPU build does): with one decoder layer's code called 30
times a step they were ~1,270 calls a step, 1-2 ms of a 12-15 ms decode step of SmolLM2
on two cores, for what the form check and the key above already pin.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree

from common.engine.file_lock import exclusive_file_lock
from kernels.cpu.build import cpu_flags
from kernels.cpu_attention import cpu_attention_backend
from kernels.cpu_linear import native_gemv_available

logger = logging.getLogger(__name__)

# A saved method not loaded or written for this long is removed when another file of the
# same method is saved: each new key (a torch upgrade, an edit of this module, another
# thread count) leaves its predecessor behind, while keys in use side by side (the offline
# engine and a local stack's one-thread workers differ in thread count) are touched at
# every load and stay.
STALE_ARTIFACT_AGE_S = 14 * 24 * 3600


class PrecompiledMethod:
    """model.<method_name>, compiled at its first call or loaded from cache_dir.

    fallback gives the method compiled the usual way (dynamo at each start), used where
    the ahead-of-time compile fails."""

    def __init__(self, model: torch.nn.Module, method_name: str, cache_dir: Path,
                 fallback: Callable[[], Callable]):
        self.model = model
        self.method_name = method_name
        self.cache_dir = cache_dir
        self.fallback = fallback
        self._compiled: Callable | None = None
        # The first call's form (see the module's docstring), which every call keeps.
        self._form: _ArgumentForm | None = None
        # How this process got it: "loaded", "compiled" or "fallback" (None before the first call).
        self.source: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._compiled
        form = _ArgumentForm.of(args, kwargs)
        if compiled is None:
            compiled = self._compiled = self._load_or_compile(args, kwargs)
            self._form = form
        elif form != self._form:
            # The saved code was traced for the first call's arguments; with no guards it would
            # run another form (a keyword it never saw, an fp32 tensor where it read bf16) as
            # if it were the first.
            raise TypeError(f"{self.name} was compiled for {self._form.describe_difference(form)}")
        return compiled(*args, **kwargs)

    @property
    def name(self) -> str:
        return f"{type(self.model).__name__}.{self.method_name}"

    @property
    def artifact_path(self) -> Path:
        return self.cache_dir / f"{self.name}-{_artifact_key(self.model, self.method_name)}.bin"

    def _load_or_compile(self, args: tuple, kwargs: dict) -> Callable:
        path = self.artifact_path
        # A saved file is whole (written beside, then renamed into place): it is loaded without
        # the lock, so processes starting together on a warm cache (prefill and decode on one
        # host) load side by side rather than one after the other.
        loaded, refused = self._load_saved(path, refused=None)
        if loaded is not None:
            return loaded
        lock_path = path.with_suffix(".lock")
        # Processes starting together need the same file: one compiles it, the others wait
        # and load it rather than each compiling.
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(exclusive_file_lock(lock_path, on_wait=lambda: logger.info(
                    "waiting for another process compiling %s into %s", self.name, path)))
            except OSError as exc:  # an unwritable cache directory: compile alone (and warn at saving)
                logger.warning("cannot lock %s (%s)", lock_path, exc)
            return self._load_or_compile_locked(path, args, kwargs, refused)

    def _load_saved(self, path: Path, refused: tuple | None) -> tuple[Callable | None, tuple | None]:
        """(the saved method, bound to the model, or None; the identity of the file read, or
        None where there is none). refused: a file's identity already read and refused (stale,
        unreadable), which is not read again; one saved since has another."""
        try:
            stat = path.stat()
        except OSError:
            return None, None
        identity = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if identity == refused:
            return None, identity
        started = time.perf_counter()
        loaded = _load(path, self.name, getattr(type(self.model), self.method_name).__globals__)
        if loaded is None:
            return None, identity
        logger.info("loaded the compiled %s from %s in %.1f s", self.name, path, time.perf_counter() - started)
        _mark_used(path)
        self.source = "loaded"
        return functools.partial(loaded, self.model), identity

    def _load_or_compile_locked(self, path: Path, args: tuple, kwargs: dict, refused: tuple | None) -> Callable:
        what = self.name
        started = time.perf_counter()
        method = getattr(type(self.model), self.method_name)
        loaded, _ = self._load_saved(path, refused)  # saved meanwhile by the process that held the lock
        if loaded is not None:
            return loaded
        try:
            # Every dimension its own symbol: with duck shapes, two sizes equal at the first
            # call (a block size and a head dim both 16) become one, and a restart with
            # another block size would fail the code's size check.
            _mark_argument_sizes_dynamic(args, kwargs)
            with fx_config.patch(use_duck_shape=False):
                compiled = torch.compile(method, dynamic=None, fullgraph=True,
                                         options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe,
                                                  "size_asserts": False}
                                         ).aot_compile(((self.model, *args), kwargs))
        except Exception as exc:  # noqa: BLE001 - any failure leaves the usual compile, which works
            logger.warning("cannot compile %s ahead of time (%s: %s); it is compiled at each start instead",
                           what, type(exc).__name__, exc)
            self.source = "fallback"
            return self.fallback()
        compiled.disable_guard_check()  # there are none: see the module's docstring
        try:
            compiled.save_compiled_function(str(path))  # written beside, then renamed into place
        except Exception as exc:  # noqa: BLE001 - a full disk or an object pickle refuses: run unsaved
            logger.warning("cannot save the compiled %s to %s (%s: %s): the next start compiles it again",
                           what, path, type(exc).__name__, exc)
        else:
            remove_stale_artifacts(self.cache_dir, self.name, keep=path)
        logger.info("compiled %s ahead of time in %.1f s (saved to %s)", what, time.perf_counter() - started, path)
        self.source = "compiled"
        return functools.partial(compiled, self.model)


class _ArgumentForm(NamedTuple):
    """What of a call's arguments the saved code depends on beyond their sizes."""
    num_args: int
    keywords: tuple[str, ...]
    # Per argument in order (positional, then keywords; lists and tuples flattened): a
    # tensor's (dtype, dim, contiguous), or a plain value itself.
    leaves: tuple[Any, ...]

    @classmethod
    def of(cls, args: tuple, kwargs: dict) -> _ArgumentForm:
        leaves: list[Any] = []
        _append_leaves(args, leaves)
        _append_leaves(tuple(kwargs.values()), leaves)
        return cls(len(args), tuple(kwargs), tuple(leaves))

    def describe_difference(self, other: _ArgumentForm) -> str:
        """'<what the code was compiled for>; called with <what differs>'."""
        if (self.num_args, self.keywords) != (other.num_args, other.keywords):
            return (f"{self.num_args} positional arguments and keywords {list(self.keywords)}; "
                    f"called with {other.num_args} and {list(other.keywords)}")
        index = next((i for i, (a, b) in enumerate(zip(self.leaves, other.leaves)) if a != b),
                     min(len(self.leaves), len(other.leaves)))
        return (f"{_describe_leaf(self.leaves, index)} as argument leaf {index}; "
                f"called with {_describe_leaf(other.leaves, index)}")


def _describe_leaf(leaves: tuple, index: int) -> str:
    if index >= len(leaves):
        return "nothing"
    if isinstance(leaves[index], tuple):  # a tensor's form
        dtype, dim, contiguous = leaves[index]
        return f"a {dim}-d {'' if contiguous else 'non-contiguous '}{dtype} tensor"
    return repr(leaves[index])


def _append_leaves(values: tuple | list, leaves: list[Any]) -> None:
    # Called twice a step with ~100 leaves (a KV cache per layer): plain tuples, not objects.
    tensor = torch.Tensor
    for value in values:
        if isinstance(value, tensor):
            leaves.append((value.dtype, value.dim(), value.is_contiguous()))  # a tensor's form
        elif isinstance(value, (tuple, list)):
            leaves.append(len(value))  # a plain int: a tensor's form is a tuple
            _append_leaves(value, leaves)
        elif value is None or isinstance(value, (bool, int, float, str)):
            leaves.append(value)
        else:  # an object (the attention metadata): what the code reads of it is the step's
            leaves.append(type(value))


def _mark_argument_sizes_dynamic(args: tuple, kwargs: dict) -> None:
    """Every size of every tensor argument a symbol, except those already marked unbacked."""
    for value in pytree.tree_leaves((args, kwargs)):
        if isinstance(value, torch.Tensor):
            unbacked = getattr(value, "_dynamo_unbacked_indices", set())
            dims = [dim for dim in range(value.dim()) if dim not in unbacked]
            if dims:
                torch._dynamo.maybe_mark_dynamic(value, dims)


def _mark_used(path: Path) -> None:
    """Its modification time is now: what remove_stale_artifacts goes by."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache still serves
        pass


def remove_stale_artifacts(cache_dir: Path, name: str, keep: Path, max_age_s: float = STALE_ARTIFACT_AGE_S,
                           now: float | None = None) -> list[Path]:
    """Remove the saved files of method `name` (and their locks) other than `keep` that
    were last loaded or written more than max_age_s ago; return them."""
    now = time.time() if now is None else now
    removed = []
    for path in sorted(cache_dir.glob(f"{name}-*.bin")):
        if path == keep:
            continue
        try:
            if now - path.stat().st_mtime <= max_age_s:
                continue
            path.unlink()
            path.with_suffix(".lock").unlink(missing_ok=True)
        except OSError:  # removed by another process meanwhile, or not ours to remove
            continue
        removed.append(path)
    if removed:
        logger.info("removed %d compiled %s file(s) unused for %d days: %s", len(removed), name,
                    max_age_s // 86400, ", ".join(p.name for p in removed))
    return removed


def _load(path: Path, what: str, method_globals: dict[str, Any]) -> Callable | None:
    """The compiled function in path, or None (with the reason logged) where it cannot serve.
    method_globals: the method's module's globals, which the saved code refers to."""
    try:
        with open(path, "rb") as f:
            compiled = torch.compiler.load_compiled_function(f, f_globals=method_globals)
    except Exception as exc:  # noqa: BLE001 - a truncated file, another torch's format: compile anew
        logger.warning("cannot load the compiled %s from %s (%s: %s): compiling it again",
                       what, path, type(exc).__name__, exc)
        return None
    changed = _changed_modules(compiled)
    if changed:
        logger.info("%s changed since %s was compiled: compiling it again", ", ".join(changed), what)
        return None
    compiled.disable_guard_check()
    return compiled


def _changed_modules(compiled: Any) -> list[str]:
    """The modules the compiled trace went through whose source is no longer what it was."""
    recorded: dict[str, str] = {}
    for inlined in compiled.source_info().inlined_sources:
        recorded[inlined.module] = inlined.content  # the whole module's source at compile time
    changed = []
    for name, content in sorted(recorded.items()):
        try:
            current = inspect.getsource(sys.modules.get(name) or importlib.import_module(name))
        except (ImportError, OSError, TypeError):
            current = None
        if current != content:
            changed.append(name)
    return changed


def _module_tree(model: torch.nn.Module) -> list[tuple[str, str, str]]:
    """Each module's name, class and settings as a graph depends on them: its `traced_repr()`
    where it has one (a packed linear's leaves out the kernels its op picks at run time),
    else its extra_repr."""
    return [(name, type(module).__qualname__,
             module.traced_repr() if hasattr(module, "traced_repr") else module.extra_repr())
            for name, module in model.named_modules()]


def _artifact_key(model: torch.nn.Module, method_name: str) -> str:
    """What a compiled method depends on beyond its source: a different value is a different file."""
    # Here, not at the top: importing inductor's config fixes its cache directory, which
    # compilation.py must have put into the environment first.
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    parts = [
        type(model).__module__, type(model).__qualname__, method_name,
        # The module tree, with each packed linear's weight id (a constant in the graph); the
        # config's scalars (norm eps, attention scale) are constants too.
        _module_tree(model), repr(getattr(model, "config", None)),
        [(name, tuple(t.shape), str(t.dtype), str(t.device))
         for name, t in [*model.named_parameters(), *model.named_buffers()]],
        # Choices made while tracing, and what inductor generated its C++ for.
        cpu_attention_backend(), native_gemv_available(), torch.get_num_threads(),
        inductor_config.cpp.dynamic_threads, cpu_flags(),
        # The CPU as torch uses it, which the environment may hold below the CPU's flags
        # (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA): code saved under one capability gave
        # wrong tokens (every one 0) when loaded under another.
        torch.backends.cpu.get_cpu_capability(), str(pick_vec_isa()), os.environ.get("ONEDNN_MAX_CPU_ISA"),
        torch.__version__, torch.version.git_version, sys.version,
        inspect.getsource(sys.modules[__name__]),
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
