"""Paged decode attention: one new query token per sequence against its KV blocks.

q [batch, heads, head_dim]; k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim];
block_tables [batch, max_blocks] int32; context_lens [batch] int32. GQA: query head h reads KV
head h // (heads / kv_heads). Split-KV: the context is cut into `num_splits` ranges of whole
blocks, each reduced with an online softmax, then merged (flash-decoding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from calibration.kernels.softmax import online_softmax_step


@triton.jit
def _partial_kernel(q, k_cache, v_cache, block_tables, context_lens, part_max, part_sum, part_acc, scale,
                    max_blocks, blocks_per_split, NUM_SPLITS: tl.constexpr, HEADS: tl.constexpr,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BUG: tl.constexpr):
    b, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = h // (HEADS // KV_HEADS)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.arange(0, BLOCK_SIZE)
    query = tl.load(q + (b * HEADS + h) * HEAD_DIM + d).to(tl.float32)
    context = tl.load(context_lens + b)
    num_blocks = tl.cdiv(context, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for i in range(first, last):
        block = tl.load(block_tables + b * max_blocks + i).to(tl.int64)
        tokens = i * BLOCK_SIZE + pos
        valid = tokens < context - BUG  # BUG drops the last token (tests only)
        offsets = ((block * BLOCK_SIZE + pos[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        keys = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(keys * query[None, :], axis=1) * scale, float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, values, running_max, running_sum, acc)
    slot = (b * HEADS + h) * NUM_SPLITS + split
    tl.store(part_max + slot, running_max)
    tl.store(part_sum + slot, running_sum)
    tl.store(part_acc + slot * HEAD_DIM + d, acc)


@triton.jit
def _merge_kernel(part_max, part_sum, part_acc, out, NUM_SPLITS: tl.constexpr, HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    base = (b * HEADS + h) * NUM_SPLITS
    best = tl.full((), float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        best = tl.maximum(best, tl.load(part_max + base + s))
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.load(part_max + base + s)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - best))
        total += tl.load(part_sum + base + s) * weight
        acc += tl.load(part_acc + (base + s) * HEAD_DIM + d) * weight
    tl.store(out + (b * HEADS + h) * HEAD_DIM + d, (acc / total).to(out.dtype.element_ty))


def check_decode(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q [batch, heads, head_dim]; k_cache = v_cache [num_blocks, block_size, kv_heads, head_dim]")
    batch, heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or heads % k_cache.shape[2]:
        raise ValueError("head_dim must match and heads must be a multiple of kv_heads")
    if q.dtype != k_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q and the cache must share fp16, bf16 or fp32, got {q.dtype} and {k_cache.dtype}")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError("block_tables and context_lens must be int32")
    if block_tables.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError("one block table row and one context length per sequence")
    if int(context_lens.max()) > block_tables.shape[1] * k_cache.shape[1]:
        raise ValueError("a context is longer than its block table covers")


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits: int = 1, _bug: int = 0):
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_blocks = block_tables.shape[1]
    blocks_per_split = triton.cdiv(max_blocks, num_splits)
    parts = batch * heads * num_splits
    part_max = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
    part_acc = torch.empty(parts * head_dim, dtype=torch.float32, device=q.device)
    _partial_kernel[(batch, heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, part_max, part_sum, part_acc, head_dim ** -0.5,
        max_blocks, blocks_per_split, NUM_SPLITS=num_splits, HEADS=heads, KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BUG=_bug)
    out = torch.empty_like(q)
    _merge_kernel[(batch, heads)](part_max, part_sum, part_acc, out, NUM_SPLITS=num_splits, HEADS=heads,
                                  HEAD_DIM=head_dim)
    return out


def reference(q, k_cache, v_cache, block_tables, context_lens):
    batch, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // k_cache.shape[1])].long()
        keys = k_cache[blocks].reshape(-1, k_cache.shape[2], head_dim)[:n].float()
        values = v_cache[blocks].reshape(-1, k_cache.shape[2], head_dim)[:n].float()
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * head_dim ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
