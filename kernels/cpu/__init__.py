"""C++ CPU kernels, compiled on first use into a per-machine cache (kernels/cpu/build.py)."""
