"""Shared fixtures. Kernel tests need TRITON_INTERPRET set before triton is imported."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
