"""A functional Qwen3 / Qwen3-MoE forward over a transformers model's own weights.

The sampler (prefill + KV-cache decode) and the trainer (one pass over whole sequences) both call
`forward`, with the same `Ops` and the same fixed key length `ctx_len`, so that with batch-invariant
ops a token's logits are the same bits in both. Sequences are left-aligned (token i at position i);
the cache holds `ctx_len` slots per row and attention runs over all of them under a mask (a batch-invariant
decode step over fewer only where `decode_attention.decode_widths` proved the same bits).
Both run on `fuse(model)`: the model's weights with q/k/v and gate/up stacked so that one gemm does the
work of several (fewer, larger calls; the trainer fuses with autograd, the engine once per weight sync).
Matches transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM (tested to float tolerance).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from detrl import fsdp
from detrl.models.ops import Ops, routing_weights
from detrl.models.primitives import apply_rope
from detrl.models.primitives import rope_tables as rope_tables  # re-exported: callers build the tables here


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, H]: q_proj, k_proj, v_proj stacked
    qk_norm: torch.Tensor  # [Hq + Hkv, D]: q_norm's weight per query head, then k_norm's per kv head
    o: torch.Tensor  # [H, Hq D]
    post_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # dense [2I, H] (gate_proj, up_proj stacked); MoE [E, 2I, H]
    down: torch.Tensor  # dense [H, I]; MoE [E, H, I]
    router: torch.Tensor | None = None  # MoE [E, H]


@dataclass
class Weights:
    """The forward's view of a Qwen3 model: per-layer fused tensors plus what it needs of the config."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    config: object

    def map(self, fn) -> Weights:
        """The same weights with fn applied to every tensor (e.g. a detached copy in shared memory)."""

        def each(x):
            return None if x is None else fn(x)

        layers = [
            LayerWeights(**{f.name: each(getattr(lw, f.name)) for f in fields(LayerWeights)})
            for lw in self.layers
        ]
        return Weights(fn(self.embed), layers, fn(self.norm), fn(self.lm_head), self.config)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order (two Weights of one model line up)."""
        per_layer = [getattr(lw, f.name) for lw in self.layers for f in fields(LayerWeights)]
        return [self.embed, self.norm, self.lm_head, *(t for t in per_layer if t is not None)]

    def copy_(self, other: Weights) -> None:
        """Overwrite these tensors in place with other's values (a weight sync that readers see)."""
        with torch.no_grad():
            for dst, src in zip(self.tensors(), other.tensors(), strict=True):
                dst.copy_(src)


def fuse_layer(layer, c, params: dict[str, torch.Tensor] | None = None) -> LayerWeights:
    """One decoder block's weights as the forward consumes them (q|k|v and dense gate|up concatenated).
    params: the block's tensors by name (a sharded block's gathered ones); None: the module's own."""
    get = layer.get_parameter if params is None else params.__getitem__
    if hasattr(layer.mlp, "experts"):  # Qwen3-MoE: the experts' gate/up are stacked already
        gate_up, down = get("mlp.experts.gate_up_proj"), get("mlp.experts.down_proj")
        router = get("mlp.gate.weight")
    else:
        gate_up = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")])
        down, router = get("mlp.down_proj.weight"), None
    return LayerWeights(
        input_norm=get("input_layernorm.weight"),
        qkv=torch.cat(
            [get("self_attn.q_proj.weight"), get("self_attn.k_proj.weight"), get("self_attn.v_proj.weight")]
        ),
        qk_norm=torch.cat(
            [
                get("self_attn.q_norm.weight").expand(c.num_attention_heads, -1),
                get("self_attn.k_norm.weight").expand(c.num_key_value_heads, -1),
            ]
        ),
        o=get("self_attn.o_proj.weight"),
        post_norm=get("post_attention_layernorm.weight"),
        gate_up=gate_up,
        down=down,
        router=router,
    )


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or dtype == t.dtype else t.to(dtype)


@dataclass
class ShardedLayer:
    """An FSDP2-sharded model's block `index`: gathered, fused and cast only when the forward reaches it
    (`load`, inside the layer's checkpointed function), so one block's full weights exist at a time."""

    model: object
    index: int
    dtype: torch.dtype | None

    def load(self) -> LayerWeights:
        block = fsdp.blocks(self.model)[self.index]
        lw = fuse_layer(block, self.model.config, fsdp.gather_block(self.model, block, self.dtype))
        return LayerWeights(**{f.name: _cast(getattr(lw, f.name), self.dtype) for f in fields(LayerWeights)})


def _sharded(w: Weights) -> bool:
    """A sharded model's blocks keep no gathered weights across the forward: under autograd, always recomputed."""
    return any(isinstance(lw, ShardedLayer) for lw in w.layers)


def fuse(model, dtype: torch.dtype | None = None) -> Weights:
    """The model's weights as the forward consumes them (differentiable: gradients flow to the model).

    dtype: the compute dtype (e.g. bf16 copies of float32 master weights; None or the model's own: no cast).
    An FSDP2-sharded model (collective): the root group (embedding, final norm, lm_head) gathered now, the
    blocks as `ShardedLayer`s the forward gathers one at a time.
    """
    c, inner = model.config, model.model
    if fsdp.is_sharded(model):
        root = fsdp.gather_root(model, dtype)
        embed, norm, head = (
            root[id(p)] for p in (inner.embed_tokens.weight, inner.norm.weight, model.lm_head.weight)
        )
        layers = [ShardedLayer(model, i, dtype) for i in range(len(inner.layers))]
        return Weights(_cast(embed, dtype), layers, _cast(norm, dtype), _cast(head, dtype), c)
    w = Weights(
        inner.embed_tokens.weight,
        [fuse_layer(layer, c) for layer in inner.layers],
        inner.norm.weight,
        model.lm_head.weight,
        c,
    )
    if dtype is None or dtype == w.embed.dtype:
        return w
    return w.map(lambda t: t.to(dtype))


def fused_meta(model, dtype: torch.dtype | None = None) -> Weights:
    """The fused weights' shapes as meta tensors in `dtype` (None: the parameters'): no data read, no gather.
    What an engine allocates from an FSDP2-sharded model (each parameter's global shape) before a weight sync
    (`distributed.sync_weights`) fills it; on a plain model, `fuse(model, dtype)`'s shapes."""

    def meta(p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=dtype or p.dtype, device="meta")

    c, inner = model.config, model.model
    layers = [fuse_layer(b, c, {n: meta(p) for n, p in b.named_parameters()}) for b in inner.layers]
    return Weights(
        meta(inner.embed_tokens.weight), layers, meta(inner.norm.weight), meta(model.lm_head.weight), c
    )


def engine_copy(model, dtype: torch.dtype | None, device, share: bool = False) -> Weights:
    """An engine's own copy of the fused weights in `dtype` on `device` (share: in CPU shared memory, for worker
    processes). An FSDP2-sharded model: empty tensors of the fused shapes (`fused_meta`), never a gathered
    model; the caller fills them by the streaming weight sync (builder.make_engine: distributed.sync_weights)."""
    with torch.no_grad():
        if fsdp.is_sharded(model):
            w = fused_meta(model, dtype).map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        else:
            w = fuse(model, dtype).map(lambda t: t.detach().to(device).clone())
    return w.map(lambda t: t.share_memory_()) if share else w


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [B, Hkv, ctx_len, D]
    v: list[torch.Tensor]

    @classmethod
    def empty(
        cls,
        config,
        batch: int,
        ctx_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (batch, config.num_key_value_heads, ctx_len, config.head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)],
        )


def layer_pre(h, input_norm, qkv_w, qk_norm, cos, sin, ops: Ops, heads: int, hd: int, eps: float):
    """The first half of a layer: input norm, the q/k/v gemm, q/k norms, rope. -> q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
    b, t, _ = h.shape
    qkv = ops.linear(ops.norm(h, input_norm, eps), qkv_w).view(b, t, -1, hd)  # [B, T, Hq + 2 Hkv, D]
    heads_qk = qkv[:, :, : qk_norm.shape[0]]
    if ops.norm_rope is not None:
        qk = ops.norm_rope(heads_qk, qk_norm, eps, cos, sin)
    else:
        qk = apply_rope(ops.norm(heads_qk, qk_norm, eps), cos, sin)
    qk = qk.transpose(1, 2)  # [B, Hq+Hkv, T, D]
    return qk[:, :heads], qk[:, heads:], qkv[:, :, qk_norm.shape[0] :].transpose(1, 2)


def layer_post(
    h,
    q,
    keys,
    values,
    mask,
    o_w,
    post_norm,
    gate_up,
    down,
    router,
    ops: Ops,
    top_k: int,
    norm_topk_prob: bool,
    hd: int,
    eps: float,
    forced: torch.Tensor | None = None,
):
    """The second half: attention over the keys, the o gemm and residual, the post norm, the MLP and residual.

    -> (h, ids): ids [B T, k] the experts the router chose (MoE; None when dense). forced [B T, k]: routing replay,
    the experts each token uses (-1 rows: its own choice), weighted by this router as `route` weights them.
    """
    b, t, _ = h.shape
    out = ops.attention(q, keys, values, mask, hd**-0.5)  # [B, Hq, T, D] (grouped-query: Hq = rep x Hkv)
    h = _add_linear(ops, h, out.transpose(1, 2).reshape(b, t, -1), o_w)
    x = ops.norm(h, post_norm, eps)
    if router is not None:  # Qwen3-MoE sparse block
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        logits = ops.linear(flat, router)  # [N, E]
        top_w, top_i = ops.route(logits, top_k, norm_topk_prob)  # [N, k]
        used = top_i
        if forced is not None:
            used = torch.where(forced >= 0, forced, top_i)
            top_w = routing_weights(logits, used, norm_topk_prob)
        return h + ops.moe(flat, top_w, used, gate_up, down, ops.linear, ops.silu).view_as(x), top_i
    both = ops.linear(x, gate_up)  # [B, T, 2I]: gate | up
    if ops.silu_mul is not None:
        act = ops.silu_mul(both)
    else:
        gate, up = both.chunk(2, dim=-1)
        act = ops.silu(gate) * up
    return _add_linear(ops, h, act, down), None


def _add_linear(ops: Ops, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The residual h + linear(x, w), in one fused kernel where the op set has one."""
    return h + ops.linear(x, w) if ops.linear_add is None else ops.linear_add(x, w, h)


@contextlib.contextmanager
def unique_writes():
    """Writes (scatter_, index_copy_) where no two entries of the index name the same slot: torch's plain kernels
    are then deterministic, so they run outside torch's deterministic mode, whose sort-based CUDA scatter (and its
    index checks) took 10 ms of a 16 ms decode step on an H200 (issue 16). The mode is restored after."""
    if not torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def write_slots(dst: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.scatter_(dim, index, src) where no two entries of index name the same slot (`unique_writes`)."""
    with unique_writes():
        return dst.scatter_(dim, index, src)


def _keys_values(k, v, slot, layer: int, cache: KVCache | None, ctx_len: int):
    """The keys and values a layer attends to: the sequence's own (training), or the cache after writing k, v."""
    t = k.shape[2]
    if cache is None:  # whole sequences: the keys are the sequence itself
        if t != ctx_len:
            raise ValueError(f"sequence length {t} must equal ctx_len {ctx_len}")
        return k, v
    if t == 1:  # decode: each row writes its own slot
        return write_slots(cache.k[layer], 2, slot, k), write_slots(cache.v[layer], 2, slot, v)
    cache.k[layer][:, :, :t] = k  # prefill from position 0
    cache.v[layer][:, :, :t] = v
    return cache.k[layer], cache.v[layer]


def forward(
    model,
    tokens: torch.Tensor,
    ops: Ops,
    ctx_len: int,
    rope,
    cache: KVCache | None = None,
    positions: torch.Tensor | None = None,
    last: torch.Tensor | None = None,
    head: bool = True,
    stages=(layer_pre, layer_post),
    experts: torch.Tensor | None = None,
    routes: bool = False,
):
    """tokens [B, T] -> logits [B, T, V] (or [B, V] at index `last` [B] of each row).

    `model`: a transformers Qwen3 model or its `fuse`d Weights. cache None: whole left-aligned sequences of
    length ctx_len (training). With a cache: T > 1 is a prefill at positions 0..T-1; T == 1 is a decode
    step at `positions` [B, 1]. head=False: the final normed hidden states [B, T, H] instead of logits.
    stages: (layer_pre, layer_post) or compiled versions of them (the CUDA engine's decode step); the
    cache write between them stays outside (a compiled in-place write into a graph input copies the cache).
    MoE routing replay: experts [B, T, layers, k] the expert ids each token uses in each layer (-1: the router's
    own choice). routes=True: return (out, ids), ids [B, T, layers, k] the experts the router itself chose
    (before any replay; None for a dense model).
    """
    w = model if isinstance(model, Weights) else fuse(model, ops.dtype)
    c = w.config
    b, t = tokens.shape
    dev = tokens.device
    if positions is None:
        positions = torch.arange(t, device=dev).expand(b, t)
    cos, sin = rope
    rot = cos[positions].unsqueeze(2), sin[positions].unsqueeze(2)  # [B, T, 1, D], shared by heads and layers
    mask = (
        torch.arange(ctx_len, device=dev)[None, None, None, :] <= positions[:, None, :, None]
    )  # [B, 1, T, L]
    slot = None
    if cache is not None and t == 1:  # the cache slot each row writes, shared by the layers
        slot = positions[:, None, :, None].expand(b, c.num_key_value_heads, 1, c.head_dim)  # [B, Hkv, 1, D]
    eps, hd = c.rms_norm_eps, c.head_dim
    top_k, norm_topk = getattr(c, "num_experts_per_tok", 0), getattr(c, "norm_topk_prob", False)
    pre, post = stages
    h = w.embed[tokens]  # [B, T, H]

    def layer(h, lw, i):
        lw = lw.load() if isinstance(lw, ShardedLayer) else lw  # gathered here, again in the recompute
        q, k, v = pre(h, lw.input_norm, lw.qkv, lw.qk_norm, *rot, ops, c.num_attention_heads, hd, eps)
        keys, values = _keys_values(k, v, slot, i, cache, ctx_len)
        forced = None if experts is None else experts[:, :, i].reshape(b * t, -1)  # [B T, k]
        return post(
            h,
            q,
            keys,
            values,
            mask,
            lw.o,
            lw.post_norm,
            lw.gate_up,
            lw.down,
            lw.router,
            ops,
            top_k,
            norm_topk,
            hd,
            eps,
            forced,
        )

    recompute = (ops.checkpoint or _sharded(w)) and cache is None and torch.is_grad_enabled()
    chosen = []  # per layer [B T, k] (MoE)
    for i, lw in enumerate(w.layers):
        h, ids = checkpoint(layer, h, lw, i, use_reentrant=False) if recompute else layer(h, lw, i)
        chosen.append(ids)
    if last is not None:
        h = h[torch.arange(b, device=dev), last]  # [B, H]
    h = ops.norm(h, w.norm, eps)
    out = ops.linear(h, w.lm_head) if head else h  # [B, T, V] or [B, V] (or [B, (T,) H])
    if not routes:
        return out
    return out, (None if chosen[0] is None else torch.stack(chosen, 1).view(b, t, len(chosen), -1))


def log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) [.., V]: the one definition the sampler and the trainer share."""
    return F.log_softmax(logits.float() / temperature, dim=-1)


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs of `targets` under softmax(logits / T), and the full log-distribution. [.., V] -> [..]."""
    logp = log_probs(logits, temperature)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), logp
