"""Loaded by every Python process that scripts/as_avx2.sh starts (it is on PYTHONPATH).

Only where vLLM is installed (its own venv): vLLM's CPU platform picks its kernel library
by asking torch whether the CPU has AVX-512 (vllm/platforms/cpu.py, import_kernels).
Answering no makes it load _C_AVX2, the library an AVX2-only CPU gets. pdserve's own
processes are left alone: they take the x86-64-v3 build from PDSERVE_CPU_MARCH. (First on
PYTHONPATH, this module stands in for any sitecustomize the interpreter has of its own.)
"""
import importlib.util

if importlib.util.find_spec("vllm") is not None:
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
