"""The numerical kernels of the forward pass, in two sets.

`DEFAULT_OPS` are torch's defaults (F.linear, SDPA, F.silu, grouped MoE dispatch with index_add_), as
serving engines and trainers use them: a row's result can depend on how many rows share the call.
`BATCH_INVARIANT_OPS` compute every row the same way whatever its batch-mates, batch size, padding or
prefill/decode phase, so that the sampler and the trainer produce the same bits for the same token:
- matmul: rows are padded to a multiple of ROW_TILE and run as a bmm of fixed (ROW_TILE, K) x (K, N)
  tiles, because the CPU gemm picks per-row kernels by the row count (rows < 4 differ);
- attention: products summed over the contiguous last dim, softmax over a fixed key length;
- silu: x / (1 + exp(-x)) (torch's fused silu rounds its vector tail differently);
- MoE: every expert on every token, combined in ascending expert order (ties -> lowest id).
Measured on torch 2.13 CPU (AVX512): exp, log, rsqrt, sum(-1), log_softmax(-1) are row-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROW_TILE = 16


def bi_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with per-row results independent of the number of rows. x (..., K), w (N, K)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)  # (M, K)
    m = rows.shape[0]
    padded = -(-m // ROW_TILE) * ROW_TILE
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    tiles = rows.view(padded // ROW_TILE, ROW_TILE, k)  # (M/R, R, K)
    out = torch.bmm(tiles, w.t().unsqueeze(0).expand(tiles.shape[0], k, w.shape[0]))  # (M/R, R, N)
    return out.reshape(padded, w.shape[0])[:m].reshape(*lead, w.shape[0])


def bi_silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def bi_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, H, T, D), k/v (B, H, L, D), mask (B or 1, 1, T, L) True = attend -> (B, H, T, D)."""
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3)).sum(-1) * scale  # (B, H, T, L)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # (B, H, T, L)
    return (probs.unsqueeze(-2) * v.transpose(-1, -2).unsqueeze(-3)).sum(-1)  # (B, H, T, D)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing in fp32; a stable sort makes ties go to the lowest expert id. -> (weights, ids), (N, k)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    top_w, top_i = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_w, top_i = top_w[:, :top_k], top_i[:, :top_k]  # (N, k)
    if norm_topk_prob:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(router_logits.dtype), top_i


def moe_dense_fixed_order(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """Every expert on every row; combine in ascending expert id. x (N, H) -> (N, H)."""
    num_experts = gate_up.shape[0]
    dense_w = torch.zeros(x.shape[0], num_experts, dtype=x.dtype).scatter(1, top_i, top_w)  # (N, E)
    out = torch.zeros_like(x)
    for e in range(num_experts):
        gate, up = linear(x, gate_up[e]).chunk(2, dim=-1)
        out = out + linear(silu(gate) * up, down[e]) * dense_w[:, e : e + 1]
    return out


def moe_grouped(x, top_w, top_i, gate_up, down, linear, silu) -> torch.Tensor:
    """The library dispatch: gather each expert's rows, run them as one call, index_add_ back."""
    out = torch.zeros_like(x)
    for e in torch.unique(top_i).tolist():
        token_idx, slot = torch.where(top_i == e)
        gate, up = linear(x[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = linear(silu(gate) * up, down[e]) * top_w[token_idx, slot, None]
        out = out.index_add(0, token_idx, y)
    return out


@dataclass(frozen=True)
class Ops:
    name: str
    linear: callable
    silu: callable
    attention: callable
    moe: callable


DEFAULT_OPS = Ops("default", F.linear, F.silu, sdpa_attention, moe_grouped)
BATCH_INVARIANT_OPS = Ops("batch_invariant", bi_linear, bi_silu, bi_attention, moe_dense_fixed_order)
