"""Batch-invariant attention over a paged KV pool: the invariant attention kernel (`triton_attention`), its keys
and values read through a slot map instead of a contiguous cache.

The pool holds per layer K, V [Hkv * slots, D] (head-major, as `rollout.paged.KVPool`); a row's slot map [L]
is its block table expanded to key positions (slot = block id * block_size + offset; positions past its
blocks name the zero block). The kernel runs the same key blocks of ATTN_BLOCK_N in the same order with the
same online softmax and the same dots as the contiguous kernel, so a row's output is the contiguous kernel's
bits on the gathered keys, whatever the block size or where the blocks lie. Each query row carries its own
position (chunked prefill starts mid-sequence; decode is T = 1), which the contiguous kernel takes as 0..T-1
or from the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detrl.models.triton_attention import ATTN_BLOCK_M, ATTN_BLOCK_N
from detrl.models.triton_launch import LAUNCH


@dataclass(frozen=True)
class PagedKeys:
    """What the paged kernel reads in place of a mask: each query's position and each row's slot map."""

    positions: torch.Tensor  # [B, T] int32, the position of each query token
    slots: torch.Tensor  # [B, L] int32, the pool slot of each key position
    size: int  # slots per head in the pool


@triton.jit(do_not_specialize=["T"])
def _paged_attn_kernel(
    q, k, v, o, pos_ptr, slot_ptr, T, L, Hkv, rep, size,
    sqb, sqh, sqt, sob, soh, sot, spb, ssb, scale,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    pid_m, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // Hkv, bg % Hkv
    rows = pid_m * BM + tl.arange(0, BM)  # row i: position index t = i // rep, query head g rep + i % rep
    valid = rows < rep * T
    t = rows // rep
    head = g * rep + rows % rep
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr + b * spb + t, mask=valid, other=0)
    qt = tl.load(
        q + b.to(tl.int64) * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    hi = tl.minimum(tl.max(tl.where(valid, pos, 0), axis=0) + 1, L)
    kbase = k + g.to(tl.int64) * size * D
    vbase = v + g.to(tl.int64) * size * D
    for n0 in range(0, hi, BN):
        cols = n0 + tl.arange(0, BN)
        inb = cols < L
        slot = tl.load(slot_ptr + b.to(tl.int64) * ssb + cols, mask=inb, other=0).to(tl.int64)
        kt = tl.load(kbase + slot[None, :] * D + d[:, None], mask=inb[None, :], other=0.0)  # [D, BN]
        s = tl.dot(qt, kt) * scale  # [BM, BN] fp32
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(vbase + slot[:, None] * D + d[None, :], mask=inb[:, None], other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o + b.to(tl.int64) * sob + head[:, None] * soh + t[:, None] * sot + d[None, :],
        out.to(o.dtype.element_ty),
        mask=valid[:, None],
    )


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: PagedKeys, scale: float
) -> torch.Tensor:
    """q (B, H, T, D); k, v the pool's [Hkv * size, D] of one layer; keys: positions and slot maps.
    -> (B, H, T, D): query row t attends to key positions 0..positions[b, t] of its slot map."""
    b, h, t, d = q.shape
    hkv = k.shape[0] // keys.size
    rep = h // hkv
    assert q.stride(-1) == 1 and k.is_contiguous() and v.is_contiguous()
    pos = keys.positions.to(torch.int32).contiguous()
    slots = keys.slots.to(torch.int32).contiguous()
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, T, D]
    grid = (triton.cdiv(rep * t, ATTN_BLOCK_M), b * hkv)
    _paged_attn_kernel[grid](
        q, k, v, o, pos, slots, t, slots.shape[1], hkv, rep, keys.size,
        q.stride(0), q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2),
        pos.stride(0), slots.stride(0), scale,
        D=d, BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, num_warps=4, num_stages=2, **LAUNCH,
    )  # fmt: skip
    return o
