"""CUDA's batch-invariant kernels (issue 16): Triton forwards whose per-row reduction order is fixed by
construction, shared by the CUDA engine (prefill, graph-captured decode) and the trainer.

- gemm x [M, K] @ w[N, K].T: K summed in fixed chunks (chunk_k, a function of K alone), each from zero in
  BLOCK_K-64 steps into an fp32 accumulator, the chunk sums added in order; so a row's bits ignore how many rows
  share the call, and the M/N tiles may follow M (tiles_for). Calls too small to fill the GPU split K (one program
  per chunk) and add the chunks in the same order after. The MoE's grouped form runs over a device-side tile map;
- RMSNorm: one program per row; fused kernels for the residual add (in the gemm's epilogue), silu(gate) * up and
  the q/k heads' RMSNorm + rope: the same math as the eager ops they replace, not necessarily their bits on the
  GPU (Triton's exp and division are the fast ones), which is fine: engine and trainer share this op set;
- attention: one flash-style kernel for training, prefill and decode: the grouped-query heads of a kv head
  stacked as rows, keys in fixed BLOCK_N blocks iterated in order with an online softmax; each row stops
  after the block holding its own position (a later, fully masked block would leave the state bit for bit
  unchanged: alpha = exp(0) = 1, p = 0), so a decode row over the fixed-length cache and the same token's row
  in a causal training pass reduce identically.
Backwards are deterministic torch recomputations (custom autograd Functions); their bits need not match the
forward's, only repeat run to run. No host syncs anywhere: everything is CUDA-graph capturable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_K = 64, 64  # the grouped (MoE) gemm's tiles: tile_map cuts each expert's rows by BLOCK_M
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64
CHUNK_K = 512  # the invariant gemm sums K in chunks of this many (a constant: never a function of M)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A gemm launch: tile sizes, warps, pipeline stages."""

    bm: int = 64
    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3


FIXED = Tiles()  # the reference launch of the device check (scripts/gpu_gemm_tiles.py)


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


_SMS: dict[int, int] = {}


def _sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter (tests on CPU): an H200's count
        return 132
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device.index]


# Triton's default for fusing a*b+c into one FMA changes in 3.10; fusion changes the bits, so every launch pins it
# (the value the kernels were measured with on the H200, Triton 3.6). Recorded in numerics.json.
FP_FUSION = True
LAUNCH = {"enable_fp_fusion": FP_FUSION}


def splits(m: int, k: int, n: int, sms: int = 132) -> bool:
    """Whether an m-row gemm [m, k] @ [n, k].T launches split-K (too few tiles to fill `sms` SMs)."""
    t = tiles_for(m, k, n, sms)
    return triton.cdiv(k, chunk_k(k)) > 1 and triton.cdiv(m, t.bm) * triton.cdiv(n, t.bn) < sms


def tiles_for(m: int, k: int, n: int, sms: int = 132) -> Tiles:
    """The launch tiles of an m-row gemm: the fastest measured on an H200 for its size (scripts/gpu_gemm_tiles.py,
    docs/gpu/issue16/tiles.json). Free to depend on m: on that device every tiling tried (BLOCK_M 16-128,
    BLOCK_N 32-256, BLOCK_K 32-128, 4 or 8 warps, 3 or 4 stages, split or not) gave every row the bits of the
    fixed tiles; only the K chunking sets them (and the preflight checks the row bits on every run's device)."""
    if m <= 128:  # decode: narrow tiles while the grid (with split-K) would leave SMs idle
        narrow = triton.cdiv(n, 64) * triton.cdiv(k, chunk_k(k)) < 2 * sms
        return Tiles(64, 32 if narrow else 64, 64, 4, 4)
    if m <= 1024 or n < 1024:
        return Tiles(64, 64, 64, 4, 3)
    return Tiles(128, 256, 64, 8, 3)


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
    sms = _sms(a.device)
    t = tiles or tiles_for(m, k, n, sms)
    chunk = chunk_k(k)
    chunks = triton.cdiv(k, chunk)
    grid = (triton.cdiv(m, t.bm), triton.cdiv(n, t.bn))
    if split is None:
        split = splits(m, k, n, sms) if tiles is None else chunks > 1 and grid[0] * grid[1] < sms
    r = residual if residual is not None else c
    if residual is not None and (
        residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != a.dtype
    ):
        raise ValueError(
            f"residual must be a row-major [{m}, {n}] {a.dtype}, got {tuple(residual.shape)} {residual.dtype}"
        )
    kw = dict(CHUNK=chunk, BM=t.bm, BN=t.bn, BK=t.bk, num_warps=t.warps, num_stages=t.stages, **LAUNCH)
    if not split:
        _gemm_kernel[grid](
            a,
            w,
            c,
            r,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            0,
            w.stride(0),
            w.stride(1),
            0,
            c.stride(0),
            c.stride(1),
            r.stride(0),
            c,
            c,
            c,
            GROUPED=False,
            SPLIT=False,
            RESIDUAL=residual is not None,
            **kw,
        )
        return c
    ws = torch.empty(chunks, m, n, dtype=torch.float32, device=a.device)
    _gemm_kernel[(*grid, chunks)](
        a,
        w,
        ws,
        ws,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        0,
        w.stride(0),
        w.stride(1),
        ws.stride(0),
        ws.stride(1),
        ws.stride(2),
        0,
        c,
        c,
        c,
        GROUPED=False,
        SPLIT=True,
        RESIDUAL=False,
        **kw,
    )
    block = 1024
    _chunk_sum_kernel[(triton.cdiv(m * n, block),)](
        ws,
        c,
        r,
        m * n,
        n,
        r.stride(0),
        S=chunks,
        RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=4,
        **LAUNCH,
    )
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
    """a [R, K] (rows sorted by expert), w [E, N, K], tiles from tile_map -> [R, N]: row r @ w[its expert].T.
    One chunk (the whole K), unsplit: tile_map gives every call enough programs."""
    r, k = a.shape
    n = w.shape[1]
    c = torch.empty(r, n, dtype=a.dtype, device=a.device)
    bn = block_n(n)
    e, lo, hi = tiles
    grid = (e.shape[0], triton.cdiv(n, bn))
    _gemm_kernel[grid](
        a,
        w,
        c,
        c,
        r,
        n,
        k,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        0,
        c.stride(0),
        c.stride(1),
        0,
        e,
        lo,
        hi,
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


def _recompute(fn, dy: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A kernel's backward: the gradients of its torch recomputation fn(*inputs) w.r.t. inputs, for the upstream
    gradient dy (torch's own backwards, deterministic run to run; their bits need not match the forward's)."""
    with torch.enable_grad():
        leaves = [x.detach().requires_grad_() for x in inputs]
        return torch.autograd.grad(fn(*leaves), leaves, dy)


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


# ------------------------------------------------------------------------------------- fused elementwise


@triton.jit
def _silu_mul_kernel(x, y, n_half, BLOCK: tl.constexpr):
    """y[r, j] = silu(x[r, j]) * x[r, n_half + j], rounded where eager torch rounds `F.silu(gate) * up`."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_half
    g = tl.load(x + row * 2 * n_half + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x + row * 2 * n_half + n_half + cols, mask=m, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(y + row * n_half + cols, (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=m)


def _silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        half = x2.shape[-1] // 2
        y = torch.empty(x2.shape[0], half, dtype=x.dtype, device=x.device)
        if x2.shape[0]:
            _silu_mul_kernel[(x2.shape[0], triton.cdiv(half, 1024))](
                x2, y, half, BLOCK=1024, num_warps=4, **LAUNCH
            )
        return y.view(*x.shape[:-1], half)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        (dx,) = _recompute(lambda x_: _silu_mul_torch(*x_.chunk(2, dim=-1)), dy, x)
        return dx


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> silu(gate) * up (..., I), one kernel."""
    return _SiluMul.apply(x)


@triton.jit
def _norm_rope_kernel(x, w, cos, sin, y, heads, sx1, sx2, sc, eps, D: tl.constexpr):
    """One (token, head) row: RMSNorm (the sum of squares in this kernel's own order), then rope as
    forward._rope computes it in x's dtype (x * cos + roll(x, D/2) * sin_signed, each product and the sum
    rounded)."""
    pid = tl.program_id(0)
    r1, h = pid // heads, pid % heads
    d = tl.arange(0, D)
    dr = (d + D // 2) % D  # roll(x, D/2)[d] = x[(d - D/2) mod D] = x[(d + D/2) mod D]
    base = x + r1.to(tl.int64) * sx1 + h * sx2
    xv = tl.load(base + d).to(tl.float32)
    xr = tl.load(base + dr).to(tl.float32)
    rs = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
    dt = y.dtype.element_ty
    n = (tl.load(w + h * D + d).to(tl.float32) * (xv * rs).to(dt).to(tl.float32)).to(dt)
    nr = (tl.load(w + h * D + dr).to(tl.float32) * (xr * rs).to(dt).to(tl.float32)).to(dt)
    c = tl.load(cos + r1.to(tl.int64) * sc + d).to(tl.float32)
    s = tl.load(sin + r1.to(tl.int64) * sc + d).to(tl.float32)
    out = ((n.to(tl.float32) * c).to(dt).to(tl.float32) + (nr.to(tl.float32) * s).to(dt).to(tl.float32)).to(
        dt
    )
    tl.store(y + pid.to(tl.int64) * D + d, out)


def _norm_rope_torch(x, w, eps, cos, sin):
    from detrl.models.forward import _rope
    from detrl.models.ops import rms_norm as torch_rms_norm

    return _rope(torch_rms_norm(x, w, eps), cos, sin)


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, cos, sin):
        ctx.save_for_backward(x, w, cos, sin)
        ctx.eps = eps
        b, t, heads, d = x.shape
        if w.shape != (heads, d) or d & (d - 1):
            raise ValueError(
                f"norm_rope needs per-head weights [{heads}, {d}] and a power-of-two head dim, "
                f"got weights {tuple(w.shape)}"
            )
        if x.stride(-1) != 1 or x.stride(0) != t * x.stride(1):
            x = x.contiguous()
        x3 = x.view(b * t, heads, d)
        c2, s2 = cos.expand(b, t, 1, d).reshape(b * t, d), sin.expand(b, t, 1, d).reshape(b * t, d)
        y = torch.empty(b, t, heads, d, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
        if b * t:
            _norm_rope_kernel[(b * t * heads,)](
                x3,
                w.contiguous(),
                c2,
                s2,
                y,
                heads,
                x3.stride(0),
                x3.stride(1),
                c2.stride(0),
                eps,
                D=d,
                num_warps=1,
                **LAUNCH,
            )
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, cos, sin = ctx.saved_tensors
        dx, dw = _recompute(lambda x_, w_: _norm_rope_torch(x_, w_, ctx.eps, cos, sin), dy, x, w)
        return dx, dw, None, None, None


def norm_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [B, T, heads, D] (the q/k heads of the qkv output, a strided view), per-head norm weights w [heads, D],
    cos / signed sin [B, T, 1, D] -> rope(rms_norm(x)) [B, T, heads, D], one kernel."""
    return _NormRope.apply(x, w, eps, cos, sin)


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
    tl.store(
        y + row.to(tl.int64) * H + cols,
        (wv.to(tl.float32) * normed.to(tl.float32)).to(y.dtype.element_ty),
        mask=m,
    )


def _rms_forward(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.shape[-1]
    x3 = x.reshape(
        -1, x.shape[-2] if x.dim() > 2 else 1, h
    )  # a view for the q/k heads' slice of the qkv output
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    wrows = w.numel() // h  # [H] weights: 1; the per-head q/k norms [heads, D]: heads (= x3.shape[1])
    _rms_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        w.contiguous(),
        y,
        h,
        x3.shape[1],
        wrows,
        x3.stride(0),
        x3.stride(1),
        eps,
        BLOCK=triton.next_power_of_2(h),
        num_warps=4,
        **LAUNCH,
    )
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
        dx, dw = _recompute(lambda x_, w_: torch_rms_norm(x_, w_, ctx.eps), dy, x, w)
        return dx, dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm (fp32 statistics, normed x in x's dtype, times w), one program per row."""
    return _RMSNorm.apply(x, w, eps)


# ---------------------------------------------------------------------------------------------- attention


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


def _attention_torch(q, k, v, mask, scale):
    """The same attention as transformers' eager path computes it in q's dtype (bf16): the scores and the weighted
    sum as bf16 gemms, the softmax in fp32, the probabilities cast back: the backward's recomputation (cuBLAS and
    torch's softmax: the same bits run to run, on tensor cores; a float32 recomputation cost ~0.1 s a step)."""
    rep = q.shape[1] // k.shape[1]
    t = q.shape[2]
    kk, vv = (x.repeat_interleave(rep, 1) for x in (k, v))  # [B, H, L, D]
    scores = (q @ kk.transpose(-1, -2)) * scale  # [B, H, T, L]
    if t > 1:  # rows at positions 0..T-1
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= torch.arange(t, device=q.device)[:, None]
    probs = torch.softmax(scores.float().masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    return probs @ vv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return _attention_forward(q, k, v, mask, scale)

    @staticmethod
    def backward(ctx, do):
        q, k, v, mask = ctx.saved_tensors
        dq, dk, dv = _recompute(lambda q_, k_, v_: _attention_torch(q_, k_, v_, mask, ctx.scale), do, q, k, v)
        return dq, dk, dv, None, None


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
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
        dx, dw = _recompute(
            lambda xs_, w_: torch._grouped_mm(xs_, w_.transpose(-2, -1), offs=offs), dy, xs, w
        )
        return dx, dw, None, None, None, None


def moe(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """The MoE block as two grouped gemms over the (token, expert) pairs sorted by expert (stable: ties in token
    order), each token summing its k expert outputs in slot order in fp32 (no atomics, no host sync).
    `linear` and `silu` are unused: the grouped gemm and silu_mul are the ops. x [N, H] -> [N, H]."""
    n, k = top_i.shape
    flat = top_i.reshape(-1)  # [N k]
    order = torch.argsort(flat, stable=True)  # [N k]
    ends = torch.searchsorted(flat[order], torch.arange(gate_up.shape[0], device=x.device), right=True)  # [E]
    counts = torch.diff(
        ends, prepend=ends.new_zeros(1)
    )  # rows per expert (no scatter: see forward.write_slots)
    offs = ends.to(torch.int32)
    tiles = tile_map(counts, n * k)
    xs = x[order // k]  # [N k, H]
    act = silu_mul(_GroupedLinear.apply(xs, gate_up, *tiles, offs))  # [N k, I]
    ys = _GroupedLinear.apply(act, down, *tiles, offs)  # [N k, H]
    y = ys[torch.argsort(order)].view(n, k, -1)  # back to (token, slot) order
    w = top_w.float()
    out = y[:, 0].float() * w[:, 0, None]
    for j in range(1, k):
        out = out + y[:, j].float() * w[:, j, None]
    return out.to(x.dtype)
