"""Batch-invariant attention over a paged KV pool: `triton_attention`'s kernel with its keys read through a
block table. Key positions run in the same BLOCK_N tiles in the same order with the same masks, the same dots
and the same online softmax; only the address of a key changes (position c of row b lives at pool slot
table[b, c // block_size] * block_size + c % block_size), so a row's bits equal the contiguous kernel's on the
gathered keys whatever the block size or layout. Each query row carries its own position: decode steps and
chunked prefills (a chunk starting anywhere in the sequence) are one kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from detrl.models.triton_attention import ATTN_BLOCK_M, ATTN_BLOCK_N
from detrl.models.triton_launch import LAUNCH


@dataclass
class PagedMeta:
    """What the kernel reads besides q and the pool: each row's block table [B, W] (int32, padded with a zero
    block's id), each query's position [B, T] (int32), the pool's slots per kv head and its block size."""

    table: torch.Tensor
    positions: torch.Tensor
    head_slots: int
    block_size: int
    ctx_len: int


@triton.jit(do_not_specialize=["T"])
def _paged_kernel(
    q,
    kp,
    vp,
    o,
    table,
    positions,
    T,
    L,
    Hkv,
    rep,
    head_slots,
    sqb,
    sqh,
    sqt,
    sob,
    soh,
    sot,
    stb,
    spb,
    scale,
    D: tl.constexpr,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    pid_m, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // Hkv, bg % Hkv
    rows = pid_m * BM + tl.arange(0, BM)  # row i: position index t = i // rep, query head g rep + i % rep
    valid = rows < rep * T
    t = rows // rep
    head = g * rep + rows % rep
    d = tl.arange(0, D)
    pos = tl.load(positions + b * spb + t, mask=valid, other=0)
    qt = tl.load(
        q + b.to(tl.int64) * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :],
        mask=valid[:, None],
        other=0.0,
    )
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, D), dtype=tl.float32)
    hi = tl.minimum(tl.max(tl.where(valid, pos, 0), axis=0) + 1, L)
    head_base = g.to(tl.int64) * head_slots
    for n0 in range(0, hi, BN):
        cols = n0 + tl.arange(0, BN)
        inside = cols < L
        blk = tl.load(table + b * stb + cols // BS, mask=inside, other=0)
        slot = head_base + blk.to(tl.int64) * BS + cols % BS  # [BN] the pool row of each key position
        kt = tl.load(kp + slot[None, :] * D + d[:, None], mask=inside[None, :], other=0.0)  # [D, BN]
        s = tl.dot(qt, kt) * scale  # [BM, BN] fp32
        s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(vp + slot[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)  # [BN, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        o + b.to(tl.int64) * sob + head[:, None] * soh + t[:, None] * sot + d[None, :],
        out.to(o.dtype.element_ty),
        mask=valid[:, None],
    )


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PagedMeta, scale: float
):
    """q (B, H, T, D), k/v pool (Hkv * head_slots, D) contiguous, head-major -> (B, H, T, D): row (b, t) at
    position meta.positions[b, t] attends to positions 0..that one of sequence b, through its block table."""
    b, h, t, d = q.shape
    hkv = k_pool.shape[0] // meta.head_slots
    rep = h // hkv
    assert q.stride(-1) == 1 and k_pool.is_contiguous() and v_pool.is_contiguous()
    table = meta.table.to(torch.int32).contiguous()
    positions = meta.positions.to(torch.int32).contiguous()
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, T, D]
    grid = (triton.cdiv(rep * t, ATTN_BLOCK_M), b * hkv)
    _paged_kernel[grid](
        q,
        k_pool,
        v_pool,
        o,
        table,
        positions,
        t,
        meta.ctx_len,
        hkv,
        rep,
        meta.head_slots,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        table.stride(0),
        positions.stride(0),
        scale,
        D=d,
        BS=meta.block_size,
        BM=ATTN_BLOCK_M,
        BN=ATTN_BLOCK_N,
        num_warps=4,
        **LAUNCH,
        num_stages=2,
    )
    return o
