"""The batch-invariant gemm: x [M, K] @ w [N, K].T with K summed in fixed chunks (chunk_k, a function of K alone),
each from zero in BLOCK_K-64 steps into an fp32 accumulator, the chunk sums added in order; so a row's bits ignore
how many rows share the call, and the M/N tiles may follow M (tiles_for). Calls too small to fill the GPU split K
(one program per chunk) and add the chunks in the same order after. The MoE's grouped form runs over a
device-side tile map. The residual add of `r + x @ w.T` runs in the gemm's epilogue (linear_add)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from detrl.models.triton_launch import LAUNCH
from detrl.models.triton_launch import sms as device_sms

BLOCK_M, BLOCK_K = 64, 64  # the grouped (MoE) gemm's tiles: tile_map cuts each expert's rows by BLOCK_M
CHUNK_K = 512  # the invariant gemm sums K in chunks of this many (a constant: never a function of M)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A gemm launch: tile sizes, warps, pipeline stages."""

    bm: int = 64
    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3


FIXED = Tiles()  # the reference launch of the device check (benchmarks/gpu.py tiles)


def block_n(n: int) -> int:
    """The N tile for a weight with n output columns (a function of the shape alone)."""
    return 128 if n >= 8192 else 64


def chunk_k(k: int) -> int:
    """The invariant gemm's K chunk for a weight with k input columns (a multiple of BLOCK_K)."""
    return min(CHUNK_K, triton.cdiv(k, BLOCK_K) * BLOCK_K)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a,
    b,
    c,
    r,
    M,
    N,
    K,
    sam,
    sak,
    sbe,
    sbn,
    sbk,
    scs,
    scm,
    scn,
    srm,
    tile_e,
    tile_lo,
    tile_hi,
    GROUPED: tl.constexpr,
    SPLIT: tl.constexpr,
    RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """c = a @ b.T (+ r): K summed in chunks of CHUNK, each chunk from zero in BK steps, the chunk sums added in
    order into a zero total. SPLIT: program_id(2) is the chunk, its sum stored (fp32) at c[chunk]; _chunk_sum
    adds them in the same order, so a split call gives every element the bits of an unsplit one."""
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
    a_rows = a + rows[:, None].to(tl.int64) * sam
    b_cols = b + cols[None, :].to(tl.int64) * sbn
    row_ok = rows[:, None] < hi
    col_ok = cols[None, :] < N
    if SPLIT:
        first = tl.program_id(2) * CHUNK
        last = first + CHUNK
    else:
        first = 0
        last = K
    if GROUPED:
        last = tl.where(lo < hi, last, first)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for c0 in range(first, last, CHUNK):
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(c0, c0 + CHUNK, BK):
            kk = k0 + ks
            at = tl.load(a_rows + kk[None, :] * sak, mask=row_ok & (kk[None, :] < K), other=0.0)
            bt = tl.load(b_cols + kk[:, None] * sbk, mask=col_ok & (kk[:, None] < K), other=0.0)
            acc = tl.dot(at, bt, acc)
        total += acc
    ok = row_ok & col_ok
    if SPLIT:
        tl.store(
            c + tl.program_id(2).to(tl.int64) * scs + rows[:, None].to(tl.int64) * scm + cols[None, :] * scn,
            total,
            mask=ok,
        )
    else:
        out = total.to(c.dtype.element_ty)
        if RESIDUAL:  # the eager `r + (a @ b.T)`: the gemm rounded, then added in fp32 and rounded
            rv = tl.load(r + rows[:, None].to(tl.int64) * srm + cols[None, :], mask=ok, other=0.0)
            out = (out.to(tl.float32) + rv.to(tl.float32)).to(c.dtype.element_ty)
        tl.store(c + rows[:, None].to(tl.int64) * scm + cols[None, :] * scn, out, mask=ok)


@triton.jit
def _chunk_sum_kernel(ws, c, r, MN, N, srm, S: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """c = sum over s of ws[s] (fp32, s in order, from zero), rounded to c's dtype (+ r as the gemm adds it)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(S):
        total += tl.load(ws + s * MN.to(tl.int64) + offs, mask=ok, other=0.0)
    out = total.to(c.dtype.element_ty)
    if RESIDUAL:
        rv = tl.load(r + (offs // N) * srm + offs % N, mask=ok, other=0.0)
        out = (out.to(tl.float32) + rv.to(tl.float32)).to(c.dtype.element_ty)
    tl.store(c + offs, out, mask=ok)


def splits(m: int, k: int, n: int, sms: int = 132) -> bool:
    """Whether an m-row gemm [m, k] @ [n, k].T launches split-K (too few tiles to fill `sms` SMs)."""
    t = tiles_for(m, k, n, sms)
    return triton.cdiv(k, chunk_k(k)) > 1 and triton.cdiv(m, t.bm) * triton.cdiv(n, t.bn) < sms


def tiles_for(m: int, k: int, n: int, sms: int = 132) -> Tiles:
    """The launch tiles of an m-row gemm: the fastest measured on an H200 for its size (`benchmarks/gpu.py tiles`,
    docs/gpu/). Free to depend on m: on that device every tiling tried (BLOCK_M 16-128, BLOCK_N 32-256,
    BLOCK_K 32-128, 4 or 8 warps, 3 or 4 stages, split or not) gave every row the bits of the fixed tiles; only
    the K chunking sets them (and the preflight checks the row bits on every run's device)."""
    if m <= 128:  # decode: narrow tiles while the grid (with split-K) would leave SMs idle
        narrow = triton.cdiv(n, 64) * triton.cdiv(k, chunk_k(k)) < 2 * sms
        return Tiles(64, 32 if narrow else 64, 64, 4, 4)
    if m <= 1024 or n < 1024:
        return Tiles(64, 64, 64, 4, 3)
    return Tiles(128, 256, 64, 8, 3)


def _check_residual(residual: torch.Tensor | None, a: torch.Tensor, m: int, n: int) -> None:
    if residual is not None and (
        residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != a.dtype
    ):
        raise ValueError(
            f"residual must be a row-major [{m}, {n}] {a.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )


def gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """a [M, K] @ w [N, K].T (+ residual [M, N], added as `residual + gemm` would be) -> [M, N] in a's dtype.

    Every row gets the same bits whatever M: K is summed in chunk_k(K) chunks, and a call too small to fill the
    GPU runs one program per chunk (split-K) with an ordered sum after, which gives the bits of the unsplit
    kernel. tiles / split: override the launch (the device check)."""
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0:
        return c
    n_sms = device_sms(a.device)
    t = tiles or tiles_for(m, k, n, n_sms)
    chunk = chunk_k(k)
    chunks = triton.cdiv(k, chunk)
    grid = (triton.cdiv(m, t.bm), triton.cdiv(n, t.bn))
    if split is None:
        split = splits(m, k, n, n_sms) if tiles is None else chunks > 1 and grid[0] * grid[1] < n_sms
    _check_residual(residual, a, m, n)
    r = residual if residual is not None else c
    kw = dict(CHUNK=chunk, BM=t.bm, BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages, **LAUNCH)
    if split:
        _split_gemm(a, w, c, r, residual is not None, grid, chunks, kw)
        return c
    # a, b, c, r, M, N, K; a's strides; b's (expert stride 0); c's (chunk stride 0); r's row stride; no tile map
    _gemm_kernel[grid](
        *(a, w, c, r, m, n, k, *a.stride(), 0, *w.stride(), 0, *c.stride(), r.stride(0), c, c, c),
        GROUPED=False,
        SPLIT=False,
        RESIDUAL=residual is not None,
        **kw,
    )
    return c


def _split_gemm(a, w, c, r, residual: bool, grid, chunks: int, kw: dict) -> None:
    """c = a @ w.T (+ r) as one program per K chunk into an fp32 workspace, then their ordered sum."""
    m, n = c.shape
    ws = torch.empty(chunks, m, n, dtype=torch.float32, device=a.device)
    _gemm_kernel[(*grid, chunks)](
        *(a, w, ws, ws, m, n, a.shape[1], *a.stride(), 0, *w.stride(), *ws.stride(), 0, c, c, c),
        GROUPED=False,
        SPLIT=True,
        RESIDUAL=False,
        **kw,
    )
    block = 1024
    _chunk_sum_kernel[(triton.cdiv(m * n, block),)](
        *(ws, c, r, m * n, n, r.stride(0)), S=chunks, RESIDUAL=residual, BLOCK=block, num_warps=4, **LAUNCH
    )


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
    """a [R, K] (rows sorted by expert), w [E, N, K], tiles from tile_map -> [R, N]: row r @ w[its expert].T.
    One chunk (the whole K), unsplit: tile_map gives every call enough programs."""
    r, k = a.shape
    n = w.shape[1]
    c = torch.empty(r, n, dtype=a.dtype, device=a.device)
    bn = block_n(n)
    e, lo, hi = tiles
    grid = (e.shape[0], triton.cdiv(n, bn))
    _gemm_kernel[grid](
        *(a, w, c, c, r, n, k, *a.stride(), *w.stride(), 0, *c.stride(), 0, e, lo, hi),
        GROUPED=True,
        SPLIT=False,
        RESIDUAL=False,
        CHUNK=triton.cdiv(k, BLOCK_K) * BLOCK_K,
        BM=BLOCK_M,
        BN=bn,
        BK=BLOCK_K,
        num_warps=4,
        **LAUNCH,
        num_stages=3,
    )
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


class _LinearAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, r):
        ctx.save_for_backward(x, w)
        r2 = r.reshape(-1, r.shape[-1])
        if r2.stride(-1) != 1 or r2.stride(0) != r2.shape[-1]:
            r2 = r2.contiguous()
        return gemm(x.reshape(-1, x.shape[-1]), w, residual=r2).view(r.shape)

    @staticmethod
    def backward(ctx, dy):
        dx, dw = _Linear.backward(ctx, dy)
        return dx, dw, dy


def linear_add(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """r + x @ w.T with the add in the gemm's epilogue: the bits of `r + linear(x, w)` in one kernel."""
    return _LinearAdd.apply(x, w, r)
