"""Greedy sampling's argmax over rows of fp32 or bf16 logits on the CPU (kernels/cpu/sampling.cpp)
as the torch op `torch.ops.pdserve_sampling.argmax_rows`: torch.argmax(dim=-1)'s answer
(the first largest value, a NaN above every number) in two vector passes per row, where
torch's own compares one element at a time (~2.6 ms against ~0.13 for 64 rows of a
49,152-token vocabulary on a 2-core Zen 4 EPYC).

Built on first use (kernels/cpu/build.py); without a C++ compiler, on other devices and
dtypes, argmax_rows is torch.argmax. PDSERVE_CPU_ARGMAX=0 turns the native one off.
"""
from __future__ import annotations

import functools
import logging

import torch

from kernels._backend import switched_off
from kernels.cpu.build import load_ops

log = logging.getLogger(__name__)


@functools.cache
def native_argmax_available() -> bool:
    """Whether the native argmax runs here (built and loaded once per process)."""
    if switched_off("PDSERVE_CPU_ARGMAX"):
        return False
    error = load_ops("sampling", {"pdserve_sampling::argmax_rows": _argmax_rows_fake})
    if error is not None:
        log.info("greedy sampling takes torch's argmax: %s", error)
        return False
    return True


def _argmax_rows_fake(logits):
    return logits.new_empty((logits.shape[0],), dtype=torch.long)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab_size] -> [num_rows] int64, as logits.argmax(dim=-1)."""
    if (logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1 and native_argmax_available()):
        return torch.ops.pdserve_sampling.argmax_rows(logits)
    return logits.argmax(dim=-1)
