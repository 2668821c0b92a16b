"""Causal prefill attention for a chunk of new tokens after an already-cached prefix (chunked
prefill, or a prefix-cache hit): query i of the chunk sees keys 0 .. cached + i.

q [batch, new, heads, head_dim]; k, v [batch, cached + new, kv_heads, head_dim].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kernel(q, k, v, out, scale, cached, new, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
            HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BUG: tl.constexpr):
    b, h, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = h // (HEADS // KV_HEADS)
    total = cached + new
    d = tl.arange(0, HEAD_DIM)
    rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < new
    q_offsets = ((b * new + rows[:, None]) * HEADS + h) * HEAD_DIM + d[None, :]
    queries = tl.load(q + q_offsets, mask=row_ok[:, None], other=0.0)
    running_max = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, HEAD_DIM), tl.float32)
    last_key = tl.minimum(cached + (tile + 1) * BLOCK_Q, total)
    for start in range(0, last_key, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        kv_offsets = ((b * total + cols[:, None]) * KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        keys = tl.load(k + kv_offsets, mask=(cols < total)[:, None], other=0.0)
        values = tl.load(v + kv_offsets, mask=(cols < total)[:, None], other=0.0)
        scores = tl.dot(queries, tl.trans(keys)).to(tl.float32) * scale
        visible = (cols[None, :] <= cached + rows[:, None] + BUG) & (cols[None, :] < total)  # BUG: peeks ahead
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        weights = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        acc = acc * correction[:, None] + tl.dot(weights.to(values.dtype), values).to(tl.float32)
        running_max = new_max
    result = acc / tl.where(row_ok, running_sum, 1.0)[:, None]
    tl.store(out + q_offsets, result.to(out.dtype.element_ty), mask=row_ok[:, None])


def prefill(q, k, v, block_q: int = 16, block_k: int = 16, _bug: int = 0):
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError("q [batch, new, heads, head_dim]; k = v [batch, cached + new, kv_heads, head_dim]")
    batch, new, heads, head_dim = q.shape
    if k.shape[1] < new or k.shape[3] != head_dim or heads % k.shape[2]:
        raise ValueError("k must hold at least the new tokens, head_dim must match, heads % kv_heads == 0")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError("q, k and v must share fp16, bf16 or fp32")
    out = torch.empty_like(q)
    grid = (batch, heads, triton.cdiv(new, block_q))
    _kernel[grid](q, k, v, out, head_dim ** -0.5, k.shape[1] - new, new, HEADS=heads, KV_HEADS=k.shape[2],
                  HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_K=block_k, BUG=_bug)
    return out


def reference(q, k, v):
    batch, new, heads, head_dim = q.shape
    total = k.shape[1]
    group = heads // k.shape[2]
    keys = k.float().repeat_interleave(group, dim=2)
    values = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), keys) * head_dim ** -0.5
    visible = torch.arange(total)[None, :] <= (total - new + torch.arange(new))[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), values).to(q.dtype)
