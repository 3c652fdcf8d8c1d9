"""Triton kernels for the GPU fast path (paged attention fallback, KV gather/scatter, norms, RoPE).

Each kernel comes with a torch reference in the same module; the CPU engine uses the torch
references directly. The kernels themselves arrive with the GPU fast-path work.
"""
