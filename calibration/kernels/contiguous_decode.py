"""Contiguous decode attention: each sequence's KV is one extent [max_len, kv_heads, head_dim]
(the contiguous allocator's layout), so addresses need no block table.

q [batch, heads, head_dim]; k_cache, v_cache [batch, max_len, kv_heads, head_dim];
context_lens [batch] int32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from calibration.kernels.softmax import online_softmax_step


@triton.jit
def _kernel(q, k_cache, v_cache, context_lens, out, scale, max_len, HEADS: tl.constexpr,
            KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr, BUG: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    kv_head = h // (HEADS // KV_HEADS)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.arange(0, TILE)
    query = tl.load(q + (b * HEADS + h) * HEAD_DIM + d).to(tl.float32) * (scale + BUG)  # BUG: wrong scale
    context = tl.load(context_lens + b)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    base = b.to(tl.int64) * max_len
    for start in range(0, context, TILE):
        tokens = start + pos
        valid = tokens < context
        offsets = ((base + tokens[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        keys = tl.load(k_cache + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        values = tl.load(v_cache + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(keys * query[None, :], axis=1), float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, values, running_max, running_sum, acc)
    tl.store(out + (b * HEADS + h) * HEAD_DIM + d, (acc / running_sum).to(out.dtype.element_ty))


def contiguous_decode(q, k_cache, v_cache, context_lens, tile: int = 64, _bug: int = 0):
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != q.shape[0]:
        raise ValueError("q [batch, heads, head_dim]; k_cache = v_cache [batch, max_len, kv_heads, head_dim]")
    batch, heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim or heads % k_cache.shape[2]:
        raise ValueError("head_dim must match and heads must be a multiple of kv_heads")
    if q.dtype != k_cache.dtype or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q and the cache must share fp16, bf16 or fp32, got {q.dtype} and {k_cache.dtype}")
    if context_lens.dtype != torch.int32 or int(context_lens.max()) > k_cache.shape[1] or int(context_lens.min()) < 1:
        raise ValueError("context_lens must be int32 in [1, max_len]")
    out = torch.empty_like(q)
    _kernel[(batch, heads)](q, k_cache, v_cache, context_lens, out, head_dim ** -0.5, k_cache.shape[1],
                            HEADS=heads, KV_HEADS=k_cache.shape[2], HEAD_DIM=head_dim, TILE=tile, BUG=_bug)
    return out


def reference(q, k_cache, v_cache, context_lens):
    batch, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for b in range(batch):
        n = int(context_lens[b])
        keys = k_cache[b, :n].float().repeat_interleave(group, dim=1)
        values = v_cache[b, :n].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * head_dim ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values).to(q.dtype)
    return out
