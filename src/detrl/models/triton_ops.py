"""CUDA's batch-invariant kernels (issue 16): Triton forwards whose per-row reduction order is fixed by
construction, shared by the CUDA engine (prefill, graph-captured decode) and the trainer.

- gemm x [M, K] @ w[N, K].T (and the MoE's grouped form over a device-side tile map): one program per
  (BLOCK_M rows, BLOCK_N cols) tile, K reduced in order in fixed BLOCK_K steps, fp32 accumulator; the tile
  config depends on the weight's shape only, never on M, so a row's bits ignore how many rows share the call;
- RMSNorm: one program per row;
- attention: one flash-style kernel for training, prefill and decode: the grouped-query heads of a kv head
  stacked as rows, keys in fixed BLOCK_N blocks iterated in order with an online softmax; each row stops
  after the block holding its own position (a later, fully masked block would leave the state bit for bit
  unchanged: alpha = exp(0) = 1, p = 0), so a decode row over the fixed-length cache and the same token's row
  in a causal training pass reduce identically.
Backwards are deterministic torch recomputations (custom autograd Functions); their bits need not match the
forward's, only repeat run to run. No host syncs anywhere: everything is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K = 64, 64
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64


def block_n(n: int) -> int:
    """The gemm's N tile for a weight with n output columns (a function of the shape alone)."""
    return 128 if n >= 8192 else 64


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a, b, c, M, N, K, sam, sak, sbe, sbn, sbk, scm, scn, tile_e, tile_lo, tile_hi,
                 GROUPED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if GROUPED:  # tile pid_m: rows lo..hi-1 (at most BM) of expert e; lo == hi: an unused tile
        e = tl.load(tile_e + pid_m)
        lo = tl.load(tile_lo + pid_m)
        hi = tl.load(tile_hi + pid_m)
        b += e.to(tl.int64) * sbe
    else:
        lo = pid_m * BM
        hi = M
    rows = lo + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptrs = a + rows[:, None].to(tl.int64) * sam + ks[None, :] * sak
    b_ptrs = b + cols[None, :].to(tl.int64) * sbn + ks[:, None] * sbk
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_end = tl.where(lo < hi, K, 0)
    for k0 in range(0, k_end, BK):
        at = tl.load(a_ptrs, mask=(rows[:, None] < hi) & (ks[None, :] + k0 < K), other=0.0)
        bt = tl.load(b_ptrs, mask=(cols[None, :] < N) & (ks[:, None] + k0 < K), other=0.0)
        acc = tl.dot(at, bt, acc)
        a_ptrs += BK * sak
        b_ptrs += BK * sbk
    c_ptrs = c + rows[:, None].to(tl.int64) * scm + cols[None, :] * scn
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(rows[:, None] < hi) & (cols[None, :] < N))


def gemm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ w [N, K].T -> [M, N] in a's dtype."""
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return c
    bn = block_n(n)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, bn))
    _gemm_kernel[grid](a, w, c, m, n, k, a.stride(0), a.stride(1), 0, w.stride(0), w.stride(1), c.stride(0),
                       c.stride(1), c, c, c, GROUPED=False, BM=BLOCK_M, BN=bn, BK=BLOCK_K, num_warps=4, num_stages=3)
    return c


def tile_map(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped gemm's tiles, on the device (static shapes, no host sync): rows sorted by expert, `counts`
    [E] rows per expert -> per tile (expert, first row, end row) [rows / BLOCK_M + E]; unused tiles lo == hi."""
    experts = counts.shape[0]
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    ntiles = (counts + BLOCK_M - 1) // BLOCK_M  # [E]
    tile_end = torch.cumsum(ntiles, 0)  # [E]
    i = torch.arange(-(-rows // BLOCK_M) + experts, device=counts.device)
    e = torch.searchsorted(tile_end, i, right=True)  # [T] the expert of tile i (E: unused)
    ec = e.clamp(max=experts - 1)
    lo = starts[ec] + (i - (tile_end[ec] - ntiles[ec])) * BLOCK_M
    hi = torch.where(e < experts, torch.minimum(ends[ec], lo + BLOCK_M), lo)
    return ec.to(torch.int32), lo.to(torch.int32), hi.to(torch.int32)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, tiles) -> torch.Tensor:
    """a [R, K] (rows sorted by expert), w [E, N, K], tiles from tile_map -> [R, N]: row r @ w[its expert].T."""
    r, k = a.shape
    n = w.shape[1]
    c = torch.empty(r, n, dtype=a.dtype, device=a.device)
    bn = block_n(n)
    e, lo, hi = tiles
    grid = (e.shape[0], triton.cdiv(n, bn))
    _gemm_kernel[grid](a, w, c, r, n, k, a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2),
                       c.stride(0), c.stride(1), e, lo, hi, GROUPED=True, BM=BLOCK_M, BN=bn, BK=BLOCK_K,
                       num_warps=4, num_stages=3)
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return gemm(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ w).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        return dx, dw


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (..., K) @ w (N, K).T, each row's bits independent of the other rows."""
    return _Linear.apply(x, w)


# ------------------------------------------------------------------------------------------------ RMSNorm


@triton.jit
def _rms_kernel(x, w, y, H, rows2, wrows, sx1, sx2, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r1, r2 = row // rows2, row % rows2
    cols = tl.arange(0, BLOCK)
    m = cols < H
    xv = tl.load(x + r1.to(tl.int64) * sx1 + r2 * sx2 + cols, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(xv * xv, axis=0) / H
    normed = (xv * tl.rsqrt(var + eps)).to(x.dtype.element_ty)
    wv = tl.load(w + (r2 % wrows) * H + cols, mask=m, other=0.0)
    tl.store(y + row.to(tl.int64) * H + cols, (wv.to(tl.float32) * normed.to(tl.float32)).to(y.dtype.element_ty),
             mask=m)


def _rms_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x3 = x.reshape(-1, x.shape[-2] if x.dim() > 2 else 1, h)  # a view for the q/k heads' slice of the qkv output
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    wrows = w.numel() // h  # [H] weights: 1; the per-head q/k norms [heads, D]: heads (= x3.shape[1])
    _rms_kernel[(x3.shape[0] * x3.shape[1],)](x3, w.contiguous(), y, h, x3.shape[1], wrows, x3.stride(0),
                                              x3.stride(1), eps, BLOCK=triton.next_power_of_2(h), num_warps=4)
    return y


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return _rms_forward(x, w, eps)

    @staticmethod
    def backward(ctx, dy):
        from detrl.models.ops import rms_norm as torch_rms_norm

        x, w = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(torch_rms_norm(x_, w_, ctx.eps), (x_, w_), dy)
        return dx, dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm (fp32 statistics, normed x in x's dtype, times w), one program per row."""
    return _RMSNorm.apply(x, w, eps)


# ---------------------------------------------------------------------------------------------- attention


@triton.jit(do_not_specialize=["T"])
def _attn_kernel(q, k, v, o, mask, T, L, Hkv, rep, sqb, sqh, sqt, skb, skh, skl, svb, svh, svl, sob, soh, sot,
                 smb, sml, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LP2: tl.constexpr,
                 DECODE: tl.constexpr):
    pid_m, bg = tl.program_id(0), tl.program_id(1)
    b, g = bg // Hkv, bg % Hkv
    rows = pid_m * BM + tl.arange(0, BM)  # row i of the group: position t = i // rep, query head g rep + i % rep
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
    qt = tl.load(q + b.to(tl.int64) * sqb + head[:, None] * sqh + t[:, None] * sqt + d[None, :],
                 mask=valid[:, None], other=0.0)
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
    tl.store(o + b.to(tl.int64) * sob + head[:, None] * soh + t[:, None] * sot + d[None, :],
             out.to(o.dtype.element_ty), mask=valid[:, None])


def _attention_forward(q, k, v, mask, scale):
    b, h, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = h // hkv
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and q.stride(-1) == 1
    o = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, T, D], rows of D contiguous
    m2 = mask.reshape(mask.shape[0], -1).view(torch.uint8)  # decode: [B or 1, L]
    decode = t == 1
    grid = (triton.cdiv(rep * t, ATTN_BLOCK_M), b * hkv)
    _attn_kernel[grid](q, k, v, o, m2, t, length, hkv, rep, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
                       k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1),
                       o.stride(2), m2.stride(0) if m2.shape[0] > 1 else 0, m2.stride(1), scale, D=d,
                       BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, LP2=triton.next_power_of_2(length), DECODE=decode,
                       num_warps=4, num_stages=2)
    return o


def _attention_torch(q, k, v, mask, scale):
    """The same attention in torch (fp32): the backward's recomputation."""
    rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    kk, vv = (x.float().repeat_interleave(rep, 1) for x in (k, v))  # [B, H, L, D]
    scores = (q.float() @ kk.transpose(-1, -2)) * scale  # [B, H, T, L]
    if t > 1:  # rows at positions 0..T-1
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= torch.arange(t, device=q.device)[:, None]
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ vv).to(q.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _attention_forward(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask = ctx.saved_tensors
        with torch.enable_grad():
            q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
            dq, dk, dv = torch.autograd.grad(_attention_torch(q_, k_, v_, mask, ctx.scale), (q_, k_, v_), do)
        return dq, dk, dv, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, Hkv, L, D) -> (B, H, T, D). T > 1: rows at positions 0..T-1, causal (training,
    prefill); T == 1: a decode step at the position where its mask row (B or 1, 1, 1, L) ends."""
    return _Attention.apply(q, k, v, mask, scale)


# -------------------------------------------------------------------------------------------------- MoE


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, w, tiles_e, tiles_lo, tiles_hi, offs):
        ctx.save_for_backward(xs, w, offs)
        return grouped_gemm(xs, w, (tiles_e, tiles_lo, tiles_hi))

    @staticmethod
    def backward(ctx, dy):
        xs, w, offs = ctx.saved_tensors
        with torch.enable_grad():
            xs_, w_ = xs.detach().requires_grad_(), w.detach().requires_grad_()
            dx, dw = torch.autograd.grad(torch._grouped_mm(xs_, w_.transpose(-2, -1), offs=offs), (xs_, w_), dy)
        return dx, dw, None, None, None, None


def moe(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """The MoE block as two grouped gemms over the (token, expert) pairs sorted by expert (stable: ties in token
    order), each token summing its k expert outputs in slot order in fp32 (no atomics, no host sync).
    `linear` is unused: the grouped gemm is the op. x [N, H] -> [N, H]."""
    n, k = top_i.shape
    flat = top_i.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # [N k]
    ends = torch.searchsorted(flat[order], torch.arange(gate_up.shape[0], device=x.device), right=True)  # [E]
    counts = torch.diff(ends, prepend=ends.new_zeros(1))  # rows per expert (no scatter: see forward.write_slots)
    offs = ends.to(torch.int32)
    tiles = tile_map(counts, n * k)
    xs = x[order // k]  # [N k, H]
    gate, up = _GroupedLinear.apply(xs, gate_up, *tiles, offs).chunk(2, dim=-1)  # [N k, I] each
    ys = _GroupedLinear.apply(silu(gate) * up, down, *tiles, offs)  # [N k, H]
    y = ys[torch.argsort(order)].view(n, k, -1)  # back to (token, slot) order
    w = top_w.float()
    out = y[:, 0].float() * w[:, 0, None]
    for j in range(1, k):
        out = out + y[:, j].float() * w[:, j, None]
    return out.to(x.dtype)
