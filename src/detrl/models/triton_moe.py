"""The batch-invariant MoE block: two grouped gemms over the (token, expert) pairs sorted by expert, on a
device-side tile map (no host sync: CUDA-graph capturable)."""

from __future__ import annotations

import torch

from detrl.models.triton_gemm import grouped_gemm, tile_map
from detrl.models.triton_launch import recompute
from detrl.models.triton_norm import silu_mul


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, w, tiles_e, tiles_lo, tiles_hi, offs):
        ctx.save_for_backward(xs, w, offs)
        return grouped_gemm(xs, w, (tiles_e, tiles_lo, tiles_hi))

    @staticmethod
    def backward(ctx, dy):
        xs, w, offs = ctx.saved_tensors
        dx, dw = recompute(lambda xs_, w_: torch._grouped_mm(xs_, w_.transpose(-2, -1), offs=offs), dy, xs, w)
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
