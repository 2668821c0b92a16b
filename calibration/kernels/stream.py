"""Memory-stream kernels (STREAM copy and triad): achievable HBM bandwidth from 1 MB to GBs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr, BUG: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(src + offsets, mask=mask)
    if BUG:  # only in the tests' mutation check
        values = values * 2
    tl.store(dst + offsets, values, mask=mask)


@triton.jit
def _triad_kernel(a, b, c, scalar, n, BLOCK: tl.constexpr, BUG: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(b + offsets, mask=mask)
    y = tl.load(c + offsets, mask=mask)
    if BUG:
        y = y + 1
    tl.store(a + offsets, x + scalar * y, mask=mask)


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
            raise ValueError("stream operands must be contiguous tensors of one shape and dtype")
    if first.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"stream kernels take fp16, bf16 or fp32, not {first.dtype}")


def copy(src: torch.Tensor, dst: torch.Tensor | None = None, block: int = 1024, _bug: int = 0) -> torch.Tensor:
    dst = torch.empty_like(src) if dst is None else dst
    _check(src, dst)
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, BUG=_bug)
    return dst


def triad(b: torch.Tensor, c: torch.Tensor, scalar: float, block: int = 1024, _bug: int = 0) -> torch.Tensor:
    a = torch.empty_like(b)
    _check(a, b, c)
    n = b.numel()
    _triad_kernel[(triton.cdiv(n, block),)](a, b, c, scalar, n, BLOCK=block, BUG=_bug)
    return a


def reference_copy(src: torch.Tensor) -> torch.Tensor:
    return src.clone()


def reference_triad(b: torch.Tensor, c: torch.Tensor, scalar: float) -> torch.Tensor:
    return (b.float() + scalar * c.float()).to(b.dtype)


def bytes_moved(op: str, numel: int, element_size: int) -> int:
    """Bytes read plus written: copy 2 arrays, triad 3."""
    return (2 if op == "copy" else 3) * numel * element_size
