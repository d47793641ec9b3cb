"""Batch-invariant attention: one flash-style kernel for training, prefill and decode. The grouped-query heads of
a kv head are stacked as rows, keys run in fixed BLOCK_N blocks in order with an online softmax; each row stops
after the block holding its own position (a later, fully masked block would leave the state bit for bit
unchanged: alpha = exp(0) = 1, p = 0), so a decode row over the fixed-length cache and the same token's row in a
causal training pass reduce identically. The backward recomputes in torch, the query rows in pieces of
ATTN_QUERY_CHUNK (memory bounded at long contexts)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detrl.models.primitives import ATTN_QUERY_CHUNK
from detrl.models.triton_launch import LAUNCH, recompute

ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64


@triton.jit(do_not_specialize=["T"])
def _attn_kernel(
    q,
    k,
    v,
    o,
    mask,
    T,
    L,
    Hkv,
    rep,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skl,
    svb,
    svh,
    svl,
    sob,
    soh,
    sot,
    smb,
    sml,
    scale,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    LP2: tl.constexpr,
    DECODE: tl.constexpr,
):
    pid_m, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // Hkv, bg % Hkv
    rows = pid_m * BM + tl.arange(
        0, BM
    )  # row i of the group: position t = i // rep, query head g rep + i % rep
    valid = rows < rep * T
    t = rows // rep
    head = g * rep + rows % rep
    d = tl.arange(0, D)
    if DECODE:  # one query at the position the mask row [L] ends at
        ls = tl.arange(0, LP2)
        seen = tl.load(mask + b * smb + ls * sml, mask=ls < L, other=0).to(tl.int32)
        pos = tl.zeros((BM,), dtype=tl.int32) + (tl.sum(seen, axis=0) - 1)
    else:  # rows at positions 0..T-1 (training, prefill)
        pos = t
    qt = tl.load(
        q + b.to(tl.int64) * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    hi = tl.minimum(tl.max(tl.where(valid, pos, 0), axis=0) + 1, L)
    kbase = k + b.to(tl.int64) * skb + g * skh
    vbase = v + b.to(tl.int64) * svb + g * svh
    for n0 in range(0, hi, BN):
        cols = n0 + tl.arange(0, BN)
        kt = tl.load(kbase + cols[None, :] * skl + d[:, None], mask=cols[None, :] < L, other=0.0)  # [D, BN]
        s = tl.dot(qt, kt) * scale  # [BM, BN] fp32
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(vbase + cols[:, None] * svl + d[None, :], mask=cols[:, None] < L, other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o + b.to(tl.int64) * sob + head[:, None] * soh + t[:, None] * sot + d[None, :],
        out.to(o.dtype.element_ty),
        mask=valid[:, None],
    )


def _attention_forward(q, k, v, mask, scale):
    b, h, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = h // hkv
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(
        1, 2
    )  # [B, H, T, D], rows of D contiguous
    m2 = mask.reshape(mask.shape[0], -1).view(torch.uint8)  # decode: [B or 1, L]
    decode = t == 1
    grid = (triton.cdiv(rep * t, ATTN_BLOCK_M), b * hkv)
    _attn_kernel[grid](
        q,
        k,
        v,
        o,
        m2,
        t,
        length,
        hkv,
        rep,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        m2.stride(0) if m2.shape[0] > 1 else 0,
        m2.stride(1),
        scale,
        D=d,
        BM=ATTN_BLOCK_M,
        BN=ATTN_BLOCK_N,
        LP2=triton.next_power_of_2(length),
        DECODE=decode,
        num_warps=4,
        **LAUNCH,
        num_stages=2,
    )
    return o


def _attention_torch(q, k, v, mask, scale, start: int = 0):
    """The same attention as transformers' eager path computes it in q's dtype (bf16): the scores and the weighted
    sum as bf16 gemms, the softmax in fp32, the probabilities cast back: the backward's recomputation (cuBLAS and
    torch's softmax: the same bits run to run, on tensor cores; a float32 recomputation cost ~0.1 s a step).
    T > 1: the rows sit at positions start..start+T-1 (a piece of a causal pass)."""
    rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    kk, vv = (x.repeat_interleave(rep, 1) for x in (k, v))  # [B, H, L, D]
    scores = (q @ kk.transpose(-1, -2)) * scale  # [B, H, T, L]
    if t > 1:
        rows = torch.arange(start, start + t, device=q.device)[:, None]
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return probs @ vv


def attention_backward(q, k, v, mask, scale, do, chunk: int = ATTN_QUERY_CHUNK):
    """(dq, dk, dv) of the attention by recomputation, the query rows in pieces of `chunk` (rows at positions
    0..T-1): one piece's [B, H, chunk, L] probabilities at a time, never [B, H, T, L]; dk / dv summed over the
    pieces in order in float32 (the same bits run to run). T <= chunk: one recomputation."""
    t = q.shape[2]
    if t <= chunk:
        return recompute(lambda q_, k_, v_: _attention_torch(q_, k_, v_, mask, scale), do, q, k, v)
    dq, dk, dv = (
        torch.empty_like(q),
        torch.zeros_like(k, dtype=torch.float32),
        torch.zeros_like(v, dtype=torch.float32),
    )
    for lo in range(0, t, chunk):
        hi = min(lo + chunk, t)
        dq_, dk_, dv_ = recompute(
            lambda q_, k_, v_, lo=lo: _attention_torch(q_, k_, v_, mask, scale, start=lo),
            do[:, :, lo:hi],
            q[:, :, lo:hi],
            k,
            v,
        )
        dq[:, :, lo:hi] = dq_
        dk += dk_
        dv += dv_
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _attention_forward(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, mask, ctx.scale, do)
        return dq, dk, dv, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, Hkv, L, D) -> (B, H, T, D). T > 1: rows at positions 0..T-1, causal (training,
    prefill); T == 1: a decode step at the position where its mask row (B or 1, 1, 1, L) ends."""
    return _Attention.apply(q, k, v, mask, scale)
