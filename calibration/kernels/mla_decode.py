"""MLA decode attention with absorbed projections (DeepSeek-V2/V3; REFERENCE.md section 1).

The paged cache holds one latent row per token: [num_blocks, block_size, LATENT + ROPE]
(512 + 64 = 576 for DeepSeek-V3), shared by every query head (one KV head). Scores are
q_latent . c_latent + q_rope . k_rope; the output is the softmax-weighted latent (512 wide),
which the absorbed output projection then maps back.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from calibration.kernels.softmax import online_softmax_step


@triton.jit
def _kernel(q_latent, q_rope, cache, block_tables, context_lens, out, scale, max_blocks,
            HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BUG: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    c = tl.arange(0, LATENT)
    r = tl.arange(0, ROPE)
    pos = tl.arange(0, BLOCK_SIZE)
    width = LATENT + ROPE
    ql = tl.load(q_latent + (b * HEADS + h) * LATENT + c).to(tl.float32)
    qr = tl.load(q_rope + (b * HEADS + h) * ROPE + r).to(tl.float32) * (1 - BUG)  # BUG: no RoPE part
    context = tl.load(context_lens + b)
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((LATENT,), tl.float32)
    for i in range(0, tl.cdiv(context, BLOCK_SIZE)):
        block = tl.load(block_tables + b * max_blocks + i).to(tl.int64)
        tokens = i * BLOCK_SIZE + pos
        valid = tokens < context
        rows = (block * BLOCK_SIZE + pos[:, None]) * width
        latent = tl.load(cache + rows + c[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        rope = tl.load(cache + rows + LATENT + r[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        scores = (tl.sum(latent * ql[None, :], axis=1) + tl.sum(rope * qr[None, :], axis=1)) * scale
        scores = tl.where(valid, scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_step(scores, latent, running_max, running_sum, acc)
    tl.store(out + (b * HEADS + h) * LATENT + c, (acc / running_sum).to(out.dtype.element_ty))


def mla_decode(q_latent, q_rope, cache, block_tables, context_lens, scale: float | None = None, _bug: int = 0):
    if q_latent.dim() != 3 or q_rope.dim() != 3 or cache.dim() != 3:
        raise ValueError("q_latent [batch, heads, latent], q_rope [batch, heads, rope], "
                         "cache [blocks, block_size, latent + rope]")
    batch, heads, latent = q_latent.shape
    rope = q_rope.shape[2]
    if cache.shape[2] != latent + rope or q_rope.shape[:2] != (batch, heads):
        raise ValueError(f"cache rows must be latent + rope = {latent + rope} wide")
    same_dtype = q_latent.dtype == q_rope.dtype == cache.dtype
    if not same_dtype or cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError("queries and cache must share fp16, bf16 or fp32")
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.shape[0] != batch:
        raise TypeError("block_tables [batch, max_blocks] and context_lens [batch] must be int32")
    scale = scale if scale is not None else (latent + rope) ** -0.5
    out = torch.empty_like(q_latent)
    _kernel[(batch, heads)](q_latent, q_rope, cache, block_tables, context_lens, out, scale, block_tables.shape[1],
                            HEADS=heads, LATENT=latent, ROPE=rope, BLOCK_SIZE=cache.shape[1], BUG=_bug)
    return out


def reference(q_latent, q_rope, cache, block_tables, context_lens, scale: float | None = None):
    batch, heads, latent = q_latent.shape
    scale = scale if scale is not None else cache.shape[2] ** -0.5
    out = torch.empty_like(q_latent)
    for b in range(batch):
        n = int(context_lens[b])
        rows = cache[block_tables[b, : -(-n // cache.shape[1])].long()].reshape(-1, cache.shape[2])[:n].float()
        scores = (q_latent[b].float() @ rows[:, :latent].T + q_rope[b].float() @ rows[:, latent:].T) * scale
        out[b] = (scores.softmax(dim=-1) @ rows[:, :latent]).to(q_latent.dtype)
    return out
