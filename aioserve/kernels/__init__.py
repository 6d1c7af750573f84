"""Every compute kernel: a Triton kernel, its launcher and a torch reference, side by side.

`dispatch.use_triton()` decides which of the two runs; see aioserve/kernels/dispatch.py.
"""
