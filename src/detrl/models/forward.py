"""A functional Qwen3 / Qwen3-MoE forward over a transformers model's own weights.

The sampler (prefill + KV-cache decode) and the trainer (one pass over whole sequences) both call
`forward`, with the same `Ops` and the same fixed key length `ctx_len`, so that with batch-invariant
ops a token's logits are the same bits in both. Sequences are left-aligned (token i at position i);
the cache holds `ctx_len` slots per row and attention always runs over all of them under a mask.
Matches transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM (tested to float tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from detrl.models.ops import Ops, moe_dispatch


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [B, Hkv, ctx_len, D]
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, model, batch: int, ctx_len: int) -> KVCache:
        c = model.config
        shape = (batch, c.num_key_value_heads, ctx_len, c.head_dim)
        return cls([torch.zeros(shape) for _ in range(c.num_hidden_layers)],
                   [torch.zeros(shape) for _ in range(c.num_hidden_layers)])


def rope_tables(config, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin [ctx_len, D]: transformers' values for positions 0..ctx_len-1, with the first half of
    sin negated so that rotate_half becomes a roll (see _rope)."""
    dim = config.head_dim
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    freqs = torch.arange(ctx_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, : dim // 2], sin[:, dim // 2 :]), dim=-1)  # rotate_half's sign folded in


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit, with rotate_half as a roll and its sign folded into sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def _attention_block(attn, x, rot, mask, positions, layer, cache, ctx_len, ops: Ops, eps: float):
    b, t, _ = x.shape
    hd = attn.head_dim
    q = _rms_norm(ops.linear(x, attn.q_proj.weight).view(b, t, -1, hd), attn.q_norm.weight, eps).transpose(1, 2)
    k = _rms_norm(ops.linear(x, attn.k_proj.weight).view(b, t, -1, hd), attn.k_norm.weight, eps).transpose(1, 2)
    v = ops.linear(x, attn.v_proj.weight).view(b, t, -1, hd).transpose(1, 2)  # [B, Hkv, T, D]
    c, s = rot  # [B, 1, T, D]
    q, k = _rope(q, c, s), _rope(k, c, s)
    if cache is None:  # whole sequences: the keys are the sequence itself
        if t != ctx_len:
            raise ValueError(f"sequence length {t} must equal ctx_len {ctx_len}")
        keys, values = k, v
    elif t == 1:  # decode: each row writes its own slot (scatter_: index_put_ is slow in deterministic mode)
        slot = positions[:, None, :, None].expand(b, k.shape[1], 1, hd)  # [B, Hkv, 1, D]
        keys, values = cache.k[layer].scatter_(2, slot, k), cache.v[layer].scatter_(2, slot, v)
    else:  # prefill from position 0
        cache.k[layer][:, :, :t] = k
        cache.v[layer][:, :, :t] = v
        keys, values = cache.k[layer], cache.v[layer]
    out = ops.attention(q, keys, values, mask, attn.scaling)  # [B, H, T, D] (grouped-query: H = rep x Hkv)
    return ops.linear(out.transpose(1, 2).reshape(b, t, -1), attn.o_proj.weight)


def _mlp_block(mlp, x, ops: Ops):
    if hasattr(mlp, "experts"):  # Qwen3-MoE sparse block
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        top_w, top_i = ops.route(ops.linear(flat, mlp.gate.weight), mlp.gate.top_k, mlp.gate.norm_topk_prob)
        out = moe_dispatch(flat, top_w, top_i, mlp.experts.gate_up_proj, mlp.experts.down_proj, ops.linear, ops.silu)
        return out.view_as(x)
    gate, up = ops.linear(x, mlp.gate_proj.weight), ops.linear(x, mlp.up_proj.weight)
    return ops.linear(ops.silu(gate) * up, mlp.down_proj.weight)


def forward(model, tokens: torch.Tensor, ops: Ops, ctx_len: int, rope, cache: KVCache | None = None,
            positions: torch.Tensor | None = None, last: torch.Tensor | None = None) -> torch.Tensor:
    """tokens [B, T] -> logits [B, T, V] (or [B, V] at index `last` [B] of each row).

    cache None: whole left-aligned sequences of length ctx_len (training). With a cache: T > 1 is a
    prefill at positions 0..T-1; T == 1 is a decode step at `positions` [B, 1].
    """
    b, t = tokens.shape
    if positions is None:
        positions = torch.arange(t).expand(b, t)
    inner, eps = model.model, model.config.rms_norm_eps
    cos, sin = rope
    rot = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [B, 1, T, D], shared by the layers
    mask = torch.arange(ctx_len)[None, None, None, :] <= positions[:, None, :, None]  # [B, 1, T, L]
    h = inner.embed_tokens.weight[tokens]  # [B, T, H]
    for i, layer in enumerate(inner.layers):
        h = h + _attention_block(layer.self_attn, _rms_norm(h, layer.input_layernorm.weight, eps),
                                 rot, mask, positions, i, cache, ctx_len, ops, eps)
        h = h + _mlp_block(layer.mlp, _rms_norm(h, layer.post_attention_layernorm.weight, eps), ops)
    if last is not None:
        h = h[torch.arange(b), last]  # [B, H]
    h = _rms_norm(h, inner.norm.weight, eps)
    return ops.linear(h, model.lm_head.weight)  # [B, T, V] or [B, V]


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) [.., V]: the one definition the sampler and the trainer share."""
    return F.log_softmax(logits.float() / temperature, dim=-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of `targets` under softmax(logits / T), and the full log-distribution. [.., V] -> [..]."""
    logp = log_probs(logits, temperature)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logp
