"""Triton kernels benchmarked by calibration: one file per operator, each with the @triton.jit
kernel, a launcher that checks shapes and dtypes, and a plain torch reference. Importing a kernel
module imports torch and triton; nothing in `sim` does."""
