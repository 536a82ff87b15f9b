"""Linears whose weights oneDNN has reordered once, at load, for the CPU's matmul units.

A plain `F.linear` on CPU hands oneDNN a row-major weight every call and pays its
reorder inside the call (bf16 [1536, 576] at one token: ~60 us plain, ~32 us
prepacked on the 2-core EPYC). Inductor's freezing does the same packing, but its
packed constants are mkldnn tensors, which its FX-graph cache cannot pickle: every
start recompiled every graph. Packing here instead keeps the compiled graphs free of
weights (the cache then serves a restart), and the model's own eager calls (an
early-exit draft runs part of it) get the packed linears as well.

The packed tensors are opaque (mkldnn layout): dynamo cannot fake them, so a compiled
graph reaches them through the custom op `pdserve::prepacked_linear(x, bias, weight_id,
out_features)`, where weight_id indexes this process's table. The id is a 0-d tensor, not
an int: the compiled graph takes it as an input, so one compiled decoder layer serves
every layer (an int would be a constant of the code, different in each layer). The op is
defined with torch.library's low-level API, which dispatches in ~1.5 us; a `custom_op`
wrapper costs ~20 us, and a model step makes 4 linear calls per layer.

Decode steps of up to four tokens take a native GEMV over the plain row-major weight
instead, where the CPU has AVX2 and FMA (kernels/cpu_linear.py): it reads the weight as
one sequential stream per thread, ~31 GB/s against oneDNN's ~18-20 GB/s for bf16 on the
2-core Zen 4 EPYC (fp32 on a Zen 3: ~26 vs ~22 GB/s). With AVX512-BF16, bf16 steps of 1
to panel_gemm_max_rows() tokens read a copy in column panels instead
(kernels/cpu/panel_gemm.h: outer products; as fast as the GEMV at 1-4 rows, 1.2-1.9x
oneDNN's rate at 5-64 on that EPYC; on AMX CPUs computed on the tiles,
kernels/cpu/panel_gemm_amx.h: 1.2-1.6x oneDNN's AMX calls at 1-64 rows on a 2-core Xeon),
and those weights keep no row-major copy. So do fp32 weights: their steps of 1 to
f32_panel_gemm_max_rows() tokens read fp32 panels (kernels/cpu/panel_gemm_fp32.h: as fast as
the GEMV at 1-4 rows; 1.1-3.1x oneDNN's AVX2 code at 8-64 on AVX2 builds, 1.1-1.8x its AVX-512
code at 4-64 on the Zen 4's AVX-512 build). A linear
thus holds its weight twice: packed for oneDNN, and row-major or in panels; once, in
panels serving steps of every size, with single_copy (--single-weight-copy). Where that
native library is loaded, the graph calls its op `pdserve_gemv::prepacked_linear`, which
makes the same choice in C++; `pdserve::prepacked_linear` serves elsewhere.
"""
from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from kernels.cpu_linear import (
    GEMV_MAX_ROWS,
    gemv,
    gemv_applies,
    native_gemv_available,
    pack_panels,
    panel_gemm,
    panel_rows_limit,
    panels_apply,
    panels_for_any_rows,
    q8_0_gemv_blocks,
    q8_0_max_rows,
    register_prepacked_linear,
    release_prepacked_linear,
)
from kernels.cpu_linear import prepacked_linear as native_prepacked_linear
from kernels.huge_pages import on_huge_pages

# weight_id -> (the packed weight or None, out_features, the row-major weight for the
# GEMV or None, the panel copy for panel_gemm or None); dead where its module is gone (with
# the weights it owned), and the slot is then reused, so a fresh process numbers a model's
# weights the same way each time (the compiled graphs, which hold the ids, then match the
# on-disk cache).
_PACKED_WEIGHTS: list[tuple[weakref.ref | None, int, weakref.ref | None, weakref.ref | None] | None] = []

_LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
_LIBRARY.define("prepacked_linear(Tensor x, Tensor? bias, Tensor weight_id, int out_features) -> Tensor")


def _ref(tensor: torch.Tensor | None) -> weakref.ref | None:
    return None if tensor is None else weakref.ref(tensor)


def _alive(entry) -> bool:
    packed, _, _, panels = entry
    return any(ref is not None and ref() is not None for ref in (packed, panels))


def _register(packed: torch.Tensor | None, out_features: int, row_major: torch.Tensor | None,
              panels: torch.Tensor | None) -> int:
    entry = (_ref(packed), out_features, _ref(row_major), _ref(panels))
    for weight_id, old in enumerate(_PACKED_WEIGHTS):
        if old is None or not _alive(old):
            _PACKED_WEIGHTS[weight_id] = entry
            return weight_id
    _PACKED_WEIGHTS.append(entry)
    return len(_PACKED_WEIGHTS) - 1


def _prepacked_linear_cpu(x: torch.Tensor, bias: torch.Tensor | None, weight_id: torch.Tensor,
                          out_features: int) -> torch.Tensor:
    packed, table_out_features, row_major, panels = _PACKED_WEIGHTS[int(weight_id)]
    if out_features != table_out_features:
        raise ValueError(f"prepacked_linear: linear {int(weight_id)} has {table_out_features} outputs, "
                         f"the caller expects {out_features}")
    # x [num_tokens, in_features] -> [num_tokens, out_features]
    if row_major is not None and x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS:
        return gemv(x, bias, row_major())
    if (panels is not None and x.dim() == 2 and (x.shape[0] <= panel_rows_limit(x.dtype) or packed is None)
            and x.dtype == panels().dtype):
        return panel_gemm(x, bias, panels())
    if packed is None:
        raise ValueError(f"prepacked_linear: linear {int(weight_id)} keeps only panels, which take [M, K] inputs "
                         f"of their dtype; got {x.dtype} {list(x.shape)}")
    num_rows = x.shape[0] if x.dim() == 2 else 0
    padded_rows = onednn_rows(num_rows)
    if padded_rows == num_rows:
        return torch.ops.mkldnn._linear_pointwise.default(x.contiguous(), packed(), bias, "none", [-1], "")
    padded = x.new_zeros((padded_rows, x.shape[1]))  # [padded_rows, in_features]
    padded[:num_rows] = x
    return torch.ops.mkldnn._linear_pointwise.default(padded, packed(), bias, "none", [-1], "")[:num_rows]


def onednn_rows(num_rows: int) -> int:
    """The rows oneDNN's matmul is called with for num_rows rows (0: not 2-D, as is). oneDNN
    builds (JIT-compiles) a primitive for every new row count, ~5 ms for each of a model's
    four linear shapes on a 2-core Xeon, which every prompt of a new length paid; rounded up
    to a multiple of 16, or of 1/32 of the row count's power of two from 512 rows (padding
    <= 3.1%), a few hundred primitives serve every step. kernels/cpu/gemv.cpp's onednn_rows
    is the same rule for the native op."""
    if num_rows <= 0:
        return num_rows
    granule = max(16, (1 << (num_rows.bit_length() - 1)) // 32)
    return -(-num_rows // granule) * granule


def _prepacked_linear_fake(x: torch.Tensor, bias: torch.Tensor | None, weight_id: torch.Tensor,
                           out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIBRARY.impl("prepacked_linear", _prepacked_linear_cpu, "CPU")
torch.library.register_fake("pdserve::prepacked_linear", _prepacked_linear_fake, lib=_LIBRARY)


@functools.cache
def prepacking_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs and runs a linear of this dtype here (probed once on a tiny one)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise.default(torch.zeros(1, 32, dtype=dtype), packed, None, "none", [-1], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


class PrepackedLinear(nn.Module):
    """y = x W^T + b with W held packed (not as a parameter): a loaded model's linear,
    replaced in place. bias stays a parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q8_0_blocks: torch.Tensor | None = None,
                 single_copy: bool = False):
        """q8_0_blocks [out_features, in_features // 32 * 34] uint8: the same weight as a GGUF
        stores it in Q8_0 (a quantized model's head), for decode steps' GEMV where it runs.
        single_copy: keep the weight once, in panels for panel_gemm, which then serves steps
        of every size, where it can (panels_for_any_rows(), and the weight takes panels);
        elsewhere the flag changes nothing."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.num_weight_bytes = weight.numel() * weight.element_size()
        # Where the native library is loaded, its op makes the GEMV-or-oneDNN choice in C++
        # (~5 us less per call than the Python op); it holds the weights until this module goes.
        self._native = native_gemv_available()
        self._q8_0_blocks = (on_huge_pages(q8_0_gemv_blocks(q8_0_blocks)) if self._native and q8_0_blocks is not None
                             and q8_0_blocks.shape[0] == self.out_features else None)
        # Panels whose steps the Q8_0 blocks take all of (q8_0_max_rows() at least the panels'
        # limit) would never be read.
        takes_panels = self._native and panels_apply(weight) and not (
            self._q8_0_blocks is not None and q8_0_max_rows() >= panel_rows_limit(weight.dtype))
        # fp32 panels serve steps of up to f32_panel_gemm_max_rows() tokens: longer ones keep oneDNN's.
        single_copy = single_copy and takes_panels and weight.dtype == torch.bfloat16 and panels_for_any_rows()
        # The module owns the packed weight; the table only points at it.
        self._packed = None if single_copy else torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        # What decode steps' GEMV reads, where it applies: the Q8_0 blocks (above), else a
        # row-major copy of a bf16 or fp32 weight (AVX2 and FMA) that has no panel copy.
        # Both on huge pages: a decode step streams them whole (kernels/huge_pages.py).
        # What decode steps of up to panel_gemm_max_rows() bf16 tokens read (AVX512-BF16), or
        # f32_panel_gemm_max_rows() fp32 tokens: at 1-4 tokens as fast as the GEMV's
        # rows, so such a weight keeps no row-major copy.
        self._panels = pack_panels(weight.detach(), huge_pages=True) if takes_panels else None
        self._row_major = (on_huge_pages(weight) if self._q8_0_blocks is None and self._panels is None
                           and gemv_applies(weight) else None)
        self.weight_id = _register(self._packed, self.out_features, self._row_major, self._panels)
        # A plain attribute, not a buffer: it stays on the CPU, where the ops read it.
        self.weight_id_tensor = torch.tensor(self.weight_id, device="cpu")  # [] int64
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if self._native:
            register_prepacked_linear(self.weight_id, self._packed, self._row_major, self._q8_0_blocks, self._panels)
            weakref.finalize(self, release_prepacked_linear, self.weight_id)

    @property
    def single_copy(self) -> bool:
        """Whether the weight is held once, in panels that serve steps of every size."""
        return self._packed is None

    @property
    def native(self) -> bool:
        """Whether the native library holds this linear under weight_id (its
        pdserve_gemv::prepacked_linear serves it)."""
        return self._native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native:
            return native_prepacked_linear(x, self.bias, self.weight_id_tensor, self.out_features)
        return torch.ops.pdserve.prepacked_linear(x, self.bias, self.weight_id_tensor, self.out_features)

    def traced_repr(self) -> str:
        """What a compiled graph holding this linear depends on: its op's arguments. Not the
        kernels (extra_repr's decode= and larger=): the native op picks those by weight_id at
        run time, so a decode instance holding single weight copies runs the graph a prefill
        instance compiled (common/engine/precompiled.py keys saved graphs by this)."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight_id={self.weight_id}, "
                f"native={self._native}")

    def extra_repr(self) -> str:
        kernels = ["q8_0 gemv"] if self._q8_0_blocks is not None else ["gemv"] if self._row_major is not None else []
        if self._panels is not None:
            kernels.append("panels")
        decode = ", ".join(kernels) or "onednn"
        larger = "panels" if self.single_copy else "onednn"
        return (f"in_features={self.in_features}, out_features={self.out_features}, weight_id={self.weight_id}, "
                f"decode={decode}, larger={larger}")


def prepack_linears(model: nn.Module, single_copy: bool = False) -> int:
    """Replace every dense projection linear of a single-rank CPU model by a PrepackedLinear
    (their float weights are freed with them), and pack a copy of the LM head (the embedding
    where they are tied) as `model.prepacked_head`, with the GGUF's Q8_0 blocks of that head
    for decode steps where quantization left them (`model.head_q8_0_blocks`). single_copy:
    each keeps its weight once where it can (PrepackedLinear). Returns how many were packed;
    0 where oneDNN cannot pack the model's dtype, and for a model packed before (an eager
    engine's is, ModelRunner): its head is not packed twice. Quantized projections are not
    nn.Linear and stay."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not prepacking_available(first.dtype):
        return 0
    targets = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and getattr(module, "tp_size", 1) == 1]
    for name in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, PrepackedLinear(old.weight, old.bias, single_copy=single_copy))
    head = model.embed_tokens if getattr(model, "lm_head", None) is None else model.lm_head
    num_packed = len(targets)
    if head is not None and head.tp_size == 1 and getattr(model, "prepacked_head", None) is None:
        model.prepacked_head = PrepackedLinear(head.weight, None, getattr(model, "head_q8_0_blocks", None),
                                               single_copy=single_copy)
        num_packed += 1
    return num_packed


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, packed ones included; the packed copy of a head tied to
    the embedding counts once (as the embedding)."""
    packed = sum(m.num_weight_bytes for name, m in model.named_modules()
                 if isinstance(m, PrepackedLinear) and name != "prepacked_head")
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())
