"""kvsim calibration: Triton microbenchmarks, fits and GPU profiles.

Importing this package is light: kernels and benchmarks import torch and triton themselves, so the
simulator can read packaged profiles without either installed.
"""
