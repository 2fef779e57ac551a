"""Triton kernels of the cache's hot paths, used on CUDA only; each beside the PyTorch path it replaces,
which stays the reference and the CPU's path (`quant_decode`: a quantised cache's decode attention)."""
