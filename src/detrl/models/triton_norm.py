"""Batch-invariant RMSNorm (one program per row) and the fused kernels around it: silu(gate) * up, and the q/k
heads' RMSNorm + rope. The same math as the eager ops they replace, not necessarily their bits on the GPU
(Triton's exp and division are the fast ones), which is fine: engine and trainer share this op set."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detrl.models.primitives import apply_rope
from detrl.models.primitives import rms_norm as torch_rms_norm
from detrl.models.triton_launch import LAUNCH, recompute


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
        (dx,) = recompute(lambda x_: _silu_mul_torch(*x_.chunk(2, dim=-1)), dy, x)
        return dx


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x (..., 2I) = [gate | up] -> silu(gate) * up (..., I), one kernel."""
    return _SiluMul.apply(x)


@triton.jit
def _norm_rope_kernel(x, w, cos, sin, y, heads, sx1, sx2, sc, eps, D: tl.constexpr):
    """One (token, head) row: RMSNorm (the sum of squares in this kernel's own order), then rope as
    primitives.apply_rope computes it in x's dtype (x * cos + roll(x, D/2) * sin_signed, each product and the sum
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
    return apply_rope(torch_rms_norm(x, w, eps), cos, sin)


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
        dx, dw = recompute(lambda x_, w_: _norm_rope_torch(x_, w_, ctx.eps, cos, sin), dy, x, w)
        return dx, dw, None, None, None


def norm_rope(
    x: torch.Tensor, w: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """x [B, T, heads, D] (the q/k heads of the qkv output, a strided view), per-head norm weights w [heads, D],
    cos / signed sin [B, T, 1, D] -> rope(rms_norm(x)) [B, T, heads, D], one kernel."""
    return _NormRope.apply(x, w, eps, cos, sin)


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
        x, w = ctx.saved_tensors
        dx, dw = recompute(lambda x_, w_: torch_rms_norm(x_, w_, ctx.eps), dy, x, w)
        return dx, dw, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm (fp32 statistics, normed x in x's dtype, times w), one program per row."""
    return _RMSNorm.apply(x, w, eps)
