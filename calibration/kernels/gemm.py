"""Tiled GEMM C = A @ B (bf16/fp16 in, fp32 accumulation; fp8 e4m3 inputs where the GPU has
them, 16-bit output), the projections and MLPs of every layer."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)


@triton.jit
def _gemm_kernel(a, b, c, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BUG: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K - BUG * BLOCK_K, BLOCK_K):  # BUG drops the last K tile (tests only)
        ks = k0 + rk
        tile_a = tl.load(a + rm[:, None] * stride_am + ks[None, :] * stride_ak,
                         mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        tile_b = tl.load(b + ks[:, None] * stride_bk + rn[None, :] * stride_bn,
                         mask=(ks[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(tile_a, tile_b)
    tl.store(c + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, block_m: int = 64,
         block_n: int = 64, block_k: int = 32, _bug: int = 0) -> torch.Tensor:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs A [M, K] and B [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in INPUT_DTYPES:
        raise TypeError(f"gemm inputs must share one of {INPUT_DTYPES}, got {a.dtype} and {b.dtype}")
    if out_dtype is None:
        out_dtype = torch.float16 if a.dtype == torch.float8_e4m3fn else a.dtype
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _gemm_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                       c.stride(0), c.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BUG=_bug)
    return c


def reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    out_dtype = out_dtype or (torch.float16 if a.dtype == torch.float8_e4m3fn else a.dtype)
    return (a.float() @ b.float()).to(out_dtype)
