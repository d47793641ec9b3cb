"""Eager torch math that the op sets (`ops`), the forward (`forward`) and the Triton kernels' backward
recomputations (`triton_*`) all compute: RMSNorm, rope and the zero padding of short gemm calls. Imports none of them, so none of them imports another
to reach it."""

from __future__ import annotations

import torch

# query rows per recomputed piece of a long training pass's attention (the CPU invariant op and the Triton
# attention's backward): the backward holds [B, H, ATTN_QUERY_CHUNK, L] probabilities, never [B, H, T, L]
ATTN_QUERY_CHUNK = 1024
ROW_TILE = 16  # the CPU gemm's row count from which a row's bits stop depending on the call's (ops.bi_linear)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: statistics in float32, normalised x back in x's dtype, times w."""
    xf = x.float()  # float32 input: the same tensor (no copy, the same bits as before)
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_tables(
    config, ctx_len: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [ctx_len, D]: transformers' values for positions 0..ctx_len-1, with the first half of
    sin negated so that rotate_half becomes a roll (see apply_rope). Computed on the CPU in float32 on every
    device (the same values everywhere), then cast to the compute dtype as transformers does."""
    dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    freqs = torch.arange(ctx_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    sin = emb.sin()
    cos, sin = (
        emb.cos(),
        torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1),
    )  # rotate_half's sign folded in
    return cos.to(device, dtype), sin.to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, with rotate_half as a roll and its sign folded into sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def pad_rows(a: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] with M < ROW_TILE -> [..., ROW_TILE, K], the extra rows zeros. Their results are never read
    back (a gemm row depends on its own input row only), but unfilled memory can hold denormals or NaNs, which
    slow the CPU gemm: the continuous engine's 16-row x 1,024-token decode ran its attention bmm 16x slower on
    unfilled rows (18.4 s vs 1.15 s, cProfile); and under autograd the weight gradient sums over all rows."""
    shape = (*a.shape[:-2], ROW_TILE, a.shape[-1])
    out = a.new_zeros(shape)
    out[..., : a.shape[-2], :] = a
    return out
