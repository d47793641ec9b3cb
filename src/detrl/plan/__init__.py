"""The memory planner: what each rank of a run needs, from the config's shapes alone (no weights, no data files).

    python -m detrl.plan experiment=qwen3_8b_gsm8k_grpo --world-size 8 --device-memory-gib 141 [--json PATH]

`detrl.plan.memory` holds the arithmetic (pure functions of shapes, dtypes and world size); this module maps a
`TrainConfig` onto it and is what `train.py` runs before it allocates the model (`require_fits`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from detrl.config import ConfigError, TrainConfig
from detrl.plan.memory import (
    ATTN_QUERY_CHUNK,
    GIB,
    LAYOUTS,
    TODAY,
    Layout,
    Plan,
    Shapes,
    Workload,
    attention_mode,
    min_world,
    plan,
    replace,
)

__all__ = [
    "GIB",
    "LAYOUTS",
    "Layout",
    "Plan",
    "PlanError",
    "Shapes",
    "Workload",
    "code_layout",
    "engine_layout",
    "for_config",
]


class PlanError(ConfigError):
    """The planner says the run cannot fit (one line: the largest part and what to change)."""


def shapes_of(m) -> Shapes:
    """The model's shapes: model.path's config.json when there is one (its shapes win), else the preset's."""
    c = vars(m).copy()
    if m.path is not None and (Path(m.path) / "config.json").is_file():
        c.update(json.loads((Path(m.path) / "config.json").read_text()))
        c.setdefault("num_experts", c.get("num_local_experts", 0))
    moe = m.name == "qwen3_moe"
    return Shapes(
        vocab=c["vocab_size"],
        hidden=c["hidden_size"],
        intermediate=c["intermediate_size"],
        layers=c["num_hidden_layers"],
        heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        tied=bool(c["tie_word_embeddings"]),
        experts=c["num_experts"] if moe else 0,
        top_k=c["num_experts_per_tok"] if moe else 0,
        moe_intermediate=c["moe_intermediate_size"] if moe else 0,
    )


def workload_of(cfg: TrainConfig, ctx_len: int, device: str, layout: Layout | None = None) -> Workload:
    """One rank's sizes under `cfg` (device: cpu | cuda; the compute dtype as detrl.device resolves it); the
    attention's memory per the op set and `layout.attn_backward` (None: the code's, `code_layout`)."""
    r, a = cfg.rollout, cfg.algo
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    rows = cfg.train_batch_size * r.n
    per_mini = min(rows, (a.ppo_mini_batch_size or cfg.train_batch_size) * r.n)
    evals = cfg.eval.batch_prompts * cfg.eval.n if cfg.eval.every else 0
    invariant = cfg.determinism.kernels == "batch_invariant"
    attn_backward = (layout or code_layout()).attn_backward
    attention = attention_mode(device, invariant, attn_backward, ctx_len)
    return Workload(
        device=device,
        compute_bytes=2 if dtype == "bfloat16" else 4,
        ctx_len=ctx_len,
        micro_batch=min(cfg.micro_batch_size, per_mini),
        micro_batches=-(-per_mini // cfg.micro_batch_size),
        batch_rows=rows,
        engine_requests=max(rows, evals),
        engine_batch=r.max_batch_size,
        engine_workers=r.num_workers,
        reference=a.use_kl_loss,
        preflight=invariant,
        ordered=cfg.determinism.reduce == "ordered",
        checkpointing=cfg.activation_checkpointing,
        attention=attention,
    )


def code_layout() -> Layout:
    """The layout the trainer's code has. `detrl.distributed` may declare what it does (`PLAN_LAYOUT`, a dict of
    `Layout` fields, e.g. {"gather": "block", "reduce": "shard", "attn_backward": "pieces"}); without it, the
    code as it was before those changes:
    `unsharded(model)` all-gathers every parameter in fp32 (`gather=model`, `gather_dtype=master`), the ordered
    reduce stashes every micro-batch's full gradient and all-gathers them (`reduce=stash`), `build` and the
    preflight hold the whole model on every rank (`construct=full`), the sync gathers the full state dict."""
    from detrl import distributed

    declared = getattr(distributed, "PLAN_LAYOUT", None) or {}
    return Layout(**{**vars(TODAY), **declared})


def context_bound(cfg: TrainConfig) -> int:
    """The trainer's ctx_len without data files: the longest prompt (data.max_prompt_length; for arithmetic, the
    task's own prompts, built in memory) + rollout.max_new_tokens, rounded up to 8 as the trainer does."""
    new = cfg.rollout.max_new_tokens
    if cfg.data.name == "arithmetic":
        from detrl.data import build_task, tokenizer_for
        from detrl.runtime import context_length

        if cfg.model.path is None:
            tokenizer = tokenizer_for(cfg)
            return context_length(build_task(cfg, tokenizer), tokenizer, new)
    if cfg.data.max_prompt_length <= 0:
        raise ConfigError(
            f"data.max_prompt_length={cfg.data.max_prompt_length} gives the planner no prompt-length bound; "
            "set data.max_prompt_length=N (prompts longer are left out)"
        )
    return -(-(cfg.data.max_prompt_length + new) // 8) * 8


def builds_sharded(world: int) -> bool:
    """The one decider of the construction (`builder.sharded_build`, `config_layout`): on several ranks every init
    is built sharded (model.path and the warm start from the file, models/sharded_load.py; a random init from the
    seed, each rank its rows, models/sharded_init.py); one rank builds the whole model."""
    return world > 1


def config_layout(lay: Layout, cfg: TrainConfig, world: int) -> Layout:
    """What the code does for this config: `rollout.scheduler=continuous` (the default) runs the paged engine, whose
    pool holds `rollout.kv_pool_tokens` (or, automatic, at most `rollout.kv_pool_max_tokens`) and is released while
    the trainer updates (cuda_paged.CudaPagedEngine.release), `static` the bucketed caches; a run on several ranks
    is built sharded (`builds_sharded`: from model.path or the warm start's file, or a random init from the seed;
    the preflight on one block)."""
    r = cfg.rollout
    kv = {"kv": "static"}
    if r.scheduler == "continuous":
        kv = {"kv": "paged", "kv_cap_tokens": r.kv_pool_tokens or r.kv_pool_max_tokens}
    construct = "sharded" if builds_sharded(world) else "full"
    return dataclasses.replace(lay, construct=construct, **kv)


def for_config(
    cfg: TrainConfig, ctx_len: int, world: int, device: str, budget: float, layout: Layout | None = None
) -> tuple[Plan, Shapes, Workload, Layout]:
    lay = layout or config_layout(code_layout(), cfg, world)
    s, w = shapes_of(cfg.model), workload_of(cfg, ctx_len, device, lay)
    if (
        world > 1
    ):  # a sharded model's forward always recomputes each block in the backward (models/forward.py)
        w = dataclasses.replace(w, checkpointing=True)
    return plan(s, w, lay, world, budget), s, w, lay


ADVICE = {
    "reduce buffers": "use determinism.reduce=all_reduce, or fewer micro-batches per mini-batch "
    "(a larger micro_batch_size or a smaller algo.ppo_mini_batch_size)",
    "KV pool": "lower rollout.max_batch_size",
    "reference model": "more ranks, or algo.use_kl_loss=false",
    "step batch": "a smaller train_batch_size or rollout.n",
    "weight sync": "more memory per device (the sync gathers the full fp32 model on every rank)",
    "engine weights": "more memory per device (every rank's engine holds the whole model)",
}


def smaller_activations(p: Plan, s: Shapes, w: Workload, lay: Layout, world: int) -> str:
    """The first of activation checkpointing, then halved micro-batches, at which the plan fits."""
    changes, trial = [], w
    if not w.checkpointing:
        changes, trial = ["activation_checkpointing=true"], replace(w, checkpointing=True)
    mb = trial.micro_batch
    while True:
        k = -(-w.micro_batches * w.micro_batch // mb)
        if plan(s, replace(trial, micro_batch=mb, micro_batches=k), lay, world, p.budget).fits:
            return "set " + " ".join(changes + ([f"micro_batch_size={mb}"] if mb != w.micro_batch else []))
        if mb == 1:
            return (
                f"no micro_batch_size fits ({attention_note(s, w)})"
                + "; a shorter context (data.max_prompt_length, rollout.max_new_tokens) or more memory"
            )
        mb //= 2


def attention_note(s: Shapes, w: Workload) -> str:
    """What the attention holds at one sequence a micro-batch, as the plan counts it."""
    ctx, mask = w.ctx_len, f"the [1, ctx, ctx] = [1, {w.ctx_len}, {w.ctx_len}] bool mask"
    if w.attention == "flash":
        return f"the attention holds no scores, only {mask}"
    if w.attention == "materialised":
        return (
            f"every layer saves [1, heads, ctx, ctx] = [1, {s.heads}, {ctx}, {ctx}] probabilities, and {mask}"
        )
    if w.attention == "recompute":
        return f"the attention backward rebuilds one layer's [1, {s.heads}, {ctx}, {ctx}] fp32 scores, and {mask}"
    rows = min(ctx, ATTN_QUERY_CHUNK)
    return (
        f"the attention backward holds one piece's [1, heads, min(ctx, {ATTN_QUERY_CHUNK}), ctx] = "
        f"[1, {s.heads}, {rows}, {ctx}] scores at a time, and {mask}"
    )


def advice(p: Plan, s: Shapes, w: Workload, lay: Layout, world: int = 1) -> str:
    """What to change, for the largest part of the plan's peak phase."""
    name, _ = p.largest
    if name == "activations":
        return smaller_activations(p, s, w, lay, world)
    if name in ("engine weights", "weight sync"):  # nothing shrinks them: a smaller micro-batch may still fit
        other = smaller_activations(p, s, w, lay, world)
        return ADVICE[name] + (f", or {other}" if other.startswith("set") else "")
    if name in ADVICE:
        return ADVICE[name]
    need = min_world(s, w, lay, p.budget)
    return f"use {need} or more ranks" if need else "more memory per device (no world size up to 256 fits)"


def verdict(p: Plan, s: Shapes, w: Workload, lay: Layout, world: int) -> str:
    """One line: fits, or why not and what to change."""
    head = f"{p.per_rank / GIB:.1f} GiB per rank ({p.peak_phase}) of {p.budget / GIB:.1f} GiB"
    if p.fits:
        return f"fits: {head} (world size {world}, {w.device})"
    name, nbytes = p.largest
    return (
        f"does not fit: {head} (world size {world}, {w.device}); largest part: {name} "
        f"{nbytes / GIB:.1f} GiB; {advice(p, s, w, lay, world)} (python -m detrl.plan <overrides> lists every part)"
    )


def require_fits(cfg: TrainConfig, ctx_len: int, world: int, device) -> None:
    """Before the model is built: raise PlanError (one line) when the plan exceeds what this rank has."""
    from detrl.device import available_bytes

    p, s, w, lay = for_config(cfg, ctx_len, world, device.type, available_bytes(device))
    if not p.fits:
        raise PlanError(verdict(p, s, w, lay, world))
