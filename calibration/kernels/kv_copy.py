"""KV block copy (copy-on-write of shared blocks) and gather (a sequence's blocks into one
contiguous buffer) over a paged cache [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(cache, src_ids, dst_ids, block_numel, BLOCK: tl.constexpr, BUG: tl.constexpr):
    pair, chunk = tl.program_id(0), tl.program_id(1)
    src = tl.load(src_ids + pair).to(tl.int64)
    dst = tl.load(dst_ids + pair).to(tl.int64)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel - BUG
    values = tl.load(cache + src * block_numel + offsets, mask=mask)
    tl.store(cache + dst * block_numel + offsets, values, mask=mask)


@triton.jit
def _gather_kernel(cache, block_table, out, num_blocks, block_numel, BLOCK: tl.constexpr, BUG: tl.constexpr):
    index, chunk = tl.program_id(0), tl.program_id(1)
    block = tl.load(block_table + (index + BUG) % num_blocks).to(tl.int64)  # BUG: a neighbour's block
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    tl.store(out + index.to(tl.int64) * block_numel + offsets,
             tl.load(cache + block * block_numel + offsets, mask=mask), mask=mask)


def _check(cache: torch.Tensor, *ids: torch.Tensor) -> None:
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError("cache must be contiguous [num_blocks, block_size, kv_heads, head_dim]")
    for t in ids:
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError("block ids must be 1-D int32 tensors")
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= cache.shape[0]):
            raise ValueError("block id out of range")


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, chunk: int = 1024,
                _bug: int = 0) -> torch.Tensor:
    _check(cache, src, dst)
    if src.shape != dst.shape:
        raise ValueError("src and dst must pair up")
    numel = cache[0].numel()
    _copy_blocks_kernel[(len(src), triton.cdiv(numel, chunk))](cache, src, dst, numel, BLOCK=chunk, BUG=_bug)
    return cache


def gather(cache: torch.Tensor, block_table: torch.Tensor, chunk: int = 1024, _bug: int = 0) -> torch.Tensor:
    _check(cache, block_table)
    numel = cache[0].numel()
    out = torch.empty((len(block_table),) + tuple(cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _gather_kernel[(len(block_table), triton.cdiv(numel, chunk))](cache, block_table, out, len(block_table),
                                                                  numel, BLOCK=chunk, BUG=_bug)
    return out.reshape(-1, *cache.shape[2:])


def reference_copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    out = cache.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        out[d] = cache[s]
    return out


def reference_gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    return cache[block_table.long()].reshape(-1, *cache.shape[2:])
