"""An engine's fused weights (`models.forward.Weights`) updated in place from the policy's state-dict entries, one
(name, tensor) at a time: each name maps to the part of the fused tensors it was fused into (q/k/v rows of `qkv`,
gate/up rows of `gate_up`, the q/k norm rows of `qk_norm`), so a weight sync never needs a second full model or a
gathered state dict. `copy_` casts to the engine's dtype, as `fuse(model, dtype)` does (a cast commutes with the
concatenation: the same bits)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from detrl.models.forward import Weights


def views(w: Weights) -> dict[str, torch.Tensor]:
    """State-dict name -> the view of w's tensors that it fills (q_norm / k_norm: their per-head rows, which
    `copy_` fills by broadcasting the [D] weight)."""
    c = w.config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    out = {"model.embed_tokens.weight": w.embed, "model.norm.weight": w.norm, "lm_head.weight": w.lm_head}
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": lw.input_norm,
            p + "self_attn.q_proj.weight": lw.qkv[: hq * d],
            p + "self_attn.k_proj.weight": lw.qkv[hq * d : (hq + hkv) * d],
            p + "self_attn.v_proj.weight": lw.qkv[(hq + hkv) * d :],
            p + "self_attn.q_norm.weight": lw.qk_norm[:hq],
            p + "self_attn.k_norm.weight": lw.qk_norm[hq:],
            p + "self_attn.o_proj.weight": lw.o,
            p + "post_attention_layernorm.weight": lw.post_norm,
        })  # fmt: skip
        if lw.router is not None:  # Qwen3-MoE: the experts are stacked in the model as in the engine
            out.update({
                p + "mlp.experts.gate_up_proj": lw.gate_up,
                p + "mlp.experts.down_proj": lw.down,
                p + "mlp.gate.weight": lw.router,
            })  # fmt: skip
        else:
            inter = lw.gate_up.shape[0] // 2
            out.update({
                p + "mlp.gate_proj.weight": lw.gate_up[:inter],
                p + "mlp.up_proj.weight": lw.gate_up[inter:],
                p + "mlp.down_proj.weight": lw.down,
            })  # fmt: skip
    return out


def copy_into(w: Weights, items: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Overwrite w in place with the (name, tensor) pairs of a whole state dict (any order, one at a time).
    A name w does not hold, or a name missing at the end, is an error naming it."""
    target = views(w)
    seen = set()
    with torch.no_grad():
        for name, t in items:
            if name not in target:
                raise KeyError(
                    f"weight {name!r} is not one of the engine's {len(target)} (e.g. {next(iter(target))!r})"
                )
            target[name].copy_(t)
            seen.add(name)
    missing = sorted(set(target) - seen)
    if missing:
        raise KeyError(f"the weight sync did not send {missing[0]!r} ({len(missing)} missing)")
