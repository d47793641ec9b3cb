"""The training loop: seed -> build -> for each step: rollout -> reward -> advantage -> update -> log.

Read top to bottom in `train`. The math lives in `detrl.algos`; what determinism means lives in
`detrl.determinism`; this file wires them.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import json
import time
import uuid
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from detrl import checkpoint, distributed
from detrl import determinism as det_mod
from detrl.algos import (
    ADV_ESTIMATORS,
    agg_loss,
    compute_policy_loss,
    kl_penalty,
    lr_ratio,
    old_logprobs,
    warmup_steps,
)
from detrl.algos.core import masked_mean
from detrl.algos.rollout_correction import rollout_correction
from detrl.algos.routing import layer_agreement
from detrl.collect import GroupSource, StepBatch, collect, collect_partial
from detrl.config import ConfigError, TrainConfig
from detrl.data import build_task, stop_token_ids, tokenizer_for
from detrl.device import resolve_device, resolve_dtype, to_device
from detrl.evaluate import Evaluator
from detrl.fingerprint import drift_step, params_digest, rollout_fingerprints
from detrl.models import preflight
from detrl.models.build import build_model, checkpoint_architecture
from detrl.models.forward import rope_tables
from detrl.models.logprobs import sequence_logprobs
from detrl.rollout import SamplingParams
from detrl.rollout.partial import PartialBuffer
from detrl.rollout.ranks import RankEngine
from detrl.tracking import Tracker
from detrl.warmstart import load_or_build


def context_length(task, tokenizer, max_new_tokens: int) -> int:
    """The fixed key length shared by sampler and trainer: longest prompt (train and eval splits) + new tokens,
    rounded up to 8."""
    splits = [task] + ([task.eval_task] if getattr(task, "eval_task", None) is not None else [])
    longest = max(len(ids) for t in splits for ids in t.encode_all(tokenizer))
    return -(-(longest + max_new_tokens) // 8) * 8


def cell_name(cfg: TrainConfig) -> str:
    """The sweep cell a run belongs to: everything but the replicate index."""
    partial = "on" if cfg.rollout.partial.enabled else "off"
    return f"{cfg.model.name}_{cfg.algo.name}_det-{det_mod.label(vars(cfg.determinism))}_partial-{partial}_s{cfg.seed}"


def run_name(cfg: TrainConfig) -> str:
    return f"{cell_name(cfg)}_r{cfg.repeat}"


def load_policy(cfg: TrainConfig, tokenizer, task, ctx_len: int) -> torch.nn.Module:
    """model.path's weights (float32), the cached warm start (arithmetic), or a fresh model from the seed."""
    if cfg.model.path is None and cfg.model.init == "warmstart":
        return load_or_build(cfg.model, cfg.data, cfg.warmstart, tokenizer, task, ctx_len)
    return build_model(cfg.model, seed=cfg.seed)


def update(
    model,
    ref_model,
    opt,
    batch: StepBatch,
    adv: torch.Tensor,
    cfg: TrainConfig,
    ops,
    ctx_len,
    rope,
    version: int,
    dp: distributed.DataParallel | None = None,
):
    """PPO-style update of one rollout batch, as verl's actor (compute_log_prob, then update_policy). -> metrics.

    1. Old logprobs: one no-grad pass of the policy before any update (verl's old_log_prob), with the
       reference's and the entropy. Stale partial-rollout tokens get theirs from `old_logprobs`.
       `algo.old_logprobs=current` (one epoch of one mini-batch: the same weights) skips the policy's pass and takes
       each micro-batch's gradient-pass logprobs, detached, as TRL does: ratio 1, one forward less.
    2. `algo.ppo_epochs` passes over `algo.ppo_mini_batch_size`-prompt mini-batches, in batch order; each
       mini-batch is one optimizer step, its gradient accumulated over `micro_batch_size`-sequence
       micro-batches with the mini-batch's denominators (verl's global batch info).
    Three policies: behaviour (the engine's rollout logprobs), old (1.), current (the grad pass). The clip
    ratio is current / old; `mismatch/*` compares old with behaviour on the tokens the current weights
    sampled (the same weights in two engines: 0 is true on-policy); pg_clipfrac / ppo_kl are token means
    over each mini-batch, averaged over the step's mini-batches (ppo_kl is 0 on the first one unless old
    and current differ, e.g. keep-mode stale tokens).
    Under torchrun, `dp` (`detrl.distributed.DataParallel`) says which micro-batches this rank runs, gathers
    their rows / metrics and reduces the gradients; without it, every micro-batch runs here.
    MoE with recorded routing: `mismatch/router_agreement` compares the old pass's own top-k ids with the engine's
    (with replay, each layer's own choice given the replayed layers below);
    `algo.routing_replay` makes the old and gradient passes use the engine's ids on the response tokens.
    """
    a, temp, mb = cfg.algo, cfg.rollout.temperature, cfg.micro_batch_size
    dp = dp or distributed.DataParallel(model, ordered=True)
    n = batch.input_ids.shape[0]
    fresh = (batch.versions == version).float() * batch.mask  # tokens sampled by the current weights
    # --- 1. old (and reference) logprobs, before the first update
    old_trainer, ref_logp = torch.zeros_like(batch.mask), None
    ent = torch.zeros_like(batch.mask)
    recorded = batch.routed_experts  # [N, L-1, layers, k] or None
    agree = (
        None if recorded is None else torch.zeros_like(batch.mask)
    )  # per token: fraction of layers agreeing

    def replayed(sl):  # the expert ids the trainer's passes must use (routing replay), or None
        return recorded[sl].long() if a.routing_replay else None

    reuse = a.old_logprobs == "current"
    stale_mode = cfg.rollout.partial.stale_tokens
    mine = [sl for _, sl in dp.micro_batches(0, n, mb)]
    with torch.no_grad(), distributed.unsharded(model, ref_model):
        if ref_model is not None:
            ref_logp = torch.zeros_like(batch.mask)
        for sl in mine:
            ids, mask = batch.input_ids[sl], batch.mask[sl]
            if not reuse:
                out = sequence_logprobs(
                    model,
                    ids,
                    mask,
                    ops,
                    ctx_len,
                    rope,
                    temp,
                    entropy=True,
                    experts=replayed(sl),
                    routes=agree is not None,
                )  # the router's own ids only when there are some
                old_trainer[sl], ent[sl] = out[:2]
                if agree is not None:
                    agree[sl] = layer_agreement(out[2], recorded[sl])
            if ref_model is not None:
                ref_logp[sl], _ = sequence_logprobs(ref_model, ids, mask, ops, ctx_len, rope, temp)
    if not reuse:
        old_trainer, ent, agree = dp.gather_rows([old_trainer, ent, agree], mine)
    ref_logp = dp.gather_rows([ref_logp], mine)[0]
    old, train_mask = old_logprobs(
        stale_mode, old_trainer, batch.rollout_logp, fresh, batch.mask
    )  # reuse: per micro-batch
    # trainer/rollout mismatch correction (TIS / MIS), weights on the policy loss; ones under determinism=on
    corr_w, _, corr_metrics = rollout_correction(
        old, batch.rollout_logp, train_mask, a.rollout_correction, **vars(a.rollout_corr)
    )
    # --- 2. mini-batches x epochs, one optimizer step each
    per_mini = (a.ppo_mini_batch_size or cfg.train_batch_size) * cfg.rollout.n
    lsf = a.loss_scale_factor or cfg.rollout.max_new_tokens
    per_step: dict[str, list[float]] = {
        k: [] for k in ("pg_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "grad_norm")
    }
    for _ in range(a.ppo_epochs):
        for start in range(0, n, per_mini):
            stop = min(start + per_mini, n)
            tokens = train_mask[start:stop].sum()
            # global denominators (every rank holds the whole batch); dp_size as verl's agg_loss
            agg = dict(
                mode=a.loss_agg_mode,
                batch_num_tokens=tokens,
                global_batch_size=stop - start,
                loss_scale_factor=lsf,
                dp_size=dp.loss_scale,
            )
            sums = dict.fromkeys(["pg_loss", "kl_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"], 0.0)
            records = []  # per micro-batch (key, metrics), summed in global micro-batch order below
            opt.zero_grad(set_to_none=True)
            distributed.unshard(model)  # FSDP2: the full weights for the functional forward (else a no-op)
            for key, sl in dp.micro_batches(start, stop, mb):
                mask = train_mask[sl]
                if (
                    reuse
                ):  # this micro-batch's old logprobs: its own, detached (the weights have not moved yet),
                    # over every response token (metrics); without gradients where no token trains (as recompute)
                    with contextlib.nullcontext() if mask.any() else torch.no_grad():
                        out = sequence_logprobs(
                            model,
                            batch.input_ids[sl],
                            batch.mask[sl],
                            ops,
                            ctx_len,
                            rope,
                            temp,
                            entropy=True,
                            experts=replayed(sl),
                            routes=agree is not None,
                        )
                    logp, ent_g = out[:2]
                    old_trainer[sl], ent[sl] = logp.detach(), ent_g.detach()
                    if agree is not None:
                        agree[sl] = layer_agreement(out[2], recorded[sl])
                    old[sl] = old_logprobs(
                        stale_mode, old_trainer[sl], batch.rollout_logp[sl], fresh[sl], batch.mask[sl]
                    )[0]
                if not mask.any():
                    continue
                if not reuse:
                    logp, ent_g = sequence_logprobs(
                        model,
                        batch.input_ids[sl],
                        mask,
                        ops,
                        ctx_len,
                        rope,
                        temp,
                        entropy=bool(a.entropy_coeff),
                        experts=replayed(sl),
                    )
                tok_adv = adv[sl, None].expand_as(logp)  # [n, L-1]
                pg, m = compute_policy_loss(
                    logp, old[sl], tok_adv, mask, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c
                )
                pg = (
                    pg * corr_w[sl]
                )  # MIS's dropped tokens weigh 0 and still count in the denominators (IcePop)
                loss = agg_loss(pg, mask, **agg)
                rec = {"pg_loss": loss.item() / dp.loss_scale}
                if ref_logp is not None:
                    kl = agg_loss(kl_penalty(logp, ref_logp[sl], a.kl_loss_type), mask, **agg)
                    loss = loss + a.kl_loss_coef * kl
                    rec["kl_loss"] = kl.item() / dp.loss_scale
                if a.entropy_coeff:
                    loss = loss - a.entropy_coeff * agg_loss(ent_g, mask, **agg)
                loss.backward()
                dp.after_backward(model, key)
                share = (mask.sum() / tokens).item()
                records.append(
                    (
                        key,
                        {
                            **rec,
                            **{
                                k: m[k].item() * share for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
                            },
                        },
                    )
                )
            grad_norm = dp.reduce(model, cfg.grad_clip)  # this rank's gradient shards, clipped
            if reuse:
                old_trainer, ent, agree = dp.gather_rows([old_trainer, ent, agree], mine)
            distributed.reshard(model)
            for rec in dp.gather_records(records):
                for k, v in rec.items():
                    sums[k] += v
            opt.step()
            for k, v in sums.items():
                per_step[k].append(v)
            per_step["grad_norm"].append(float(grad_norm))
    opt.zero_grad(set_to_none=True)
    if (
        reuse
    ):  # the correction's diagnostics, now that every old logprob is known (its weights were ones: none)
        old = old_logprobs(stale_mode, old_trainer, batch.rollout_logp, fresh, batch.mask)[0]
        corr_metrics = rollout_correction(
            old, batch.rollout_logp, train_mask, a.rollout_correction, **vars(a.rollout_corr)
        )[2]
    # --- mismatch: the trainer's old logprobs vs the engine's, same weights (fresh tokens)
    f = fresh > 0
    d = (old_trainer - batch.rollout_logp)[f]
    pd = (old_trainer.exp() - batch.rollout_logp.exp())[f].abs()
    stale = (batch.mask > 0) & ~f
    lag = (old_trainer - batch.rollout_logp)[stale].abs()

    def mean(x):
        return x.mean().item() if x.numel() else 0.0

    def top(x):
        return x.max().item() if x.numel() else 0.0

    return {
        **{f"actor/{k}": sum(v) / len(v) for k, v in per_step.items()},
        "actor/entropy": masked_mean(ent, batch.mask).item(),
        "actor/lr": opt.param_groups[0]["lr"],
        "actor/optimizer_steps": float(len(per_step["grad_norm"])),
        "actor/loss_token_frac": (train_mask.sum() / batch.mask.sum().clamp_min(1.0)).item(),
        "mismatch/train_rollout_logprob_abs_diff": mean(d.abs()),
        "mismatch/train_rollout_logprob_abs_diff_max": top(d.abs()),
        "mismatch/k3_kl": mean(torch.expm1(-d) + d),  # k3 of the rollout policy against the trainer's
        "mismatch/max_prob_diff": top(pd),
        "mismatch/stale_logprob_abs_diff": mean(lag),  # stale tokens: policy lag + engine mismatch
        **{k: float(v) for k, v in corr_metrics.items()},
        # fraction of fresh response (token, layer) slots where the trainer's top-k set is the engine's
        **({} if agree is None else {"mismatch/router_agreement": mean(agree[f])}),
    }


def layer_fingerprints(model, cfg: TrainConfig, step: int) -> dict[str, str]:
    """fp/layers/<i>: digests of each decoder layer's output on a fixed canary batch, every
    `layer_digests_every` steps ("" in between, so every row has the same keys); none when 0."""
    every = cfg.layer_digests_every
    if not every:
        return {}
    from detrl.forensics import layer_digests, make_canary

    n = model.config.num_hidden_layers
    if step % every:
        return {f"fp/layers/{i}": "" for i in range(n)}
    digests = layer_digests(model, make_canary(model.config.vocab_size).to(next(model.parameters()).device))
    return {f"fp/layers/{i}": digests[str(i)] for i in range(n)}


def rollout_metrics(batch: StepBatch, adv: torch.Tensor) -> dict[str, float | str]:
    lengths = torch.tensor([len(r.tokens) for r in batch.results], dtype=torch.float32)
    return {
        "critic/score/mean": batch.correct.mean().item(),
        "critic/score/max": batch.correct.max().item(),
        "critic/score/min": batch.correct.min().item(),
        "critic/rewards/mean": batch.scores.mean().item(),
        "critic/advantages/mean": adv.mean().item(),
        "critic/advantages/max": adv.max().item(),
        "critic/advantages/min": adv.min().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": sum(r.finish_reason == "length" for r in batch.results)
        / len(batch.results),
        "prompt_length/mean": sum(len(r.request.prompt_ids) for r in batch.results) / len(batch.results),
        "overlong/penalty_mean": (batch.scores - batch.correct).mean().item(),
        "dapo/kept_groups": batch.kept_groups,
        "dapo/gen_batches": batch.gen_rounds,
        **rollout_fingerprints(batch.results),  # content digests keyed by (uid, sample), and the order apart
    }


def build(cfg: TrainConfig):
    """Seed, then the pieces every entrypoint needs: (determinism, tokenizer, task, ctx_len, policy, sampling)."""
    device = resolve_device(cfg.device)
    det = det_mod.setup(
        cfg.determinism,
        cfg.seed,
        device,
        resolve_dtype(cfg.model.dtype, device),
        cfg.activation_checkpointing,
    )
    if det.device.type == "cuda" and det.invariant_kernels and det.dtype == torch.float32:
        raise ConfigError(
            "model.dtype=float32 is not valid with determinism.kernels=batch_invariant on CUDA: the "
            "Triton kernels' float32 dots run in TF32; use model.dtype=bfloat16 (or auto)"
        )
    if cfg.model.path is not None:  # one line naming what the dir lacks, or its unsupported architecture
        arch = checkpoint_architecture(cfg.model.path, need_tokenizer=True)
        if arch != cfg.model.name:
            raise ConfigError(
                f"model.path={cfg.model.path!r} holds a {arch} checkpoint; use model={arch} "
                f"(model.name={cfg.model.name!r})"
            )
    tokenizer = tokenizer_for(cfg)  # model.path's own tokenizer when given
    task = build_task(cfg, tokenizer)  # the train split; its eval split is task.eval_task
    r = cfg.rollout
    ctx_len = context_length(task, tokenizer, r.max_new_tokens)
    model = load_policy(cfg, tokenizer, task, ctx_len).to(det.device)  # float32 master weights
    if model.config.vocab_size < len(tokenizer):
        raise ConfigError(
            f"model.vocab_size={model.config.vocab_size} < the tokenizer's {len(tokenizer)} tokens"
        )
    sampling = SamplingParams(
        r.temperature, r.top_p, r.max_new_tokens, stop_token_ids(tokenizer, cfg.model.path)
    )
    return det, tokenizer, task, ctx_len, model, sampling


def make_engine(
    cfg: TrainConfig, model, det, ctx_len: int, sampling: SamplingParams, tokenizer, run_dir: Path
):
    """The rollout engine of `rollout.backend`, holding the current policy weights."""
    r = cfg.rollout
    if r.backend == "sglang":
        from detrl.rollout.sglang import SGLangEngine
        from detrl.rollout.sglang_launch import launch, server_argv, sglang_dtype, sglang_version

        s, urls, procs = r.sglang, list(r.sglang.urls), []
        dtype = det.dtype  # served in the trainer's compute dtype (bf16 on GPUs), not its fp32 masters'
        if not urls:  # launch our own servers from the current policy
            sglang_version()  # one line telling how to install it, if it is not
            init = run_dir / "sglang-init"
            model.save_pretrained(init)
            tokenizer.save_pretrained(init)
            for i in range(s.num_servers):
                argv = server_argv(
                    str(init),
                    s.port + i,
                    cfg.seed,
                    det.invariant_kernels,
                    s.attention_backend,
                    s.tp_size,
                    s.rl_on_policy_target,
                    dtype=sglang_dtype(dtype),
                )
                procs.append(
                    launch(argv, run_dir / f"sglang-{i}.log", s.gpu_ids[i] if i < len(s.gpu_ids) else None)
                )
                urls.append(f"http://127.0.0.1:{s.port + i}")
        if procs:
            atexit.register(
                lambda: [p.terminate() for p in procs if p.poll() is None]
            )  # even if we crash early
        engine = SGLangEngine(
            urls,
            sampling,
            det.fixed_routing,
            r.max_batch_size,
            timeout_s=s.timeout_s,
            retries=s.retries,
            health_timeout_s=s.health_timeout_s,
            procs=procs,
            deterministic=det.invariant_kernels,
            dtype=dtype,
        )
        engine.update_weights(model.state_dict())  # the servers start from the policy
        return engine
    if det.device.type == "cuda":
        if cfg.algo.routing_replay:
            raise ConfigError(
                f"algo.routing_replay=True is not valid: the CUDA engine (device={det.device.type}) "
                "does not record expert ids (use device=cpu)"
            )
    from detrl.rollout.registry import build_engine

    return build_engine("embedded", det.device.type, model, det, ctx_len, sampling, cfg.seed, r)


def train(cfg: TrainConfig, run_dir: Path, group: str = "default") -> dict[str, float]:
    run_dir = Path(run_dir)
    config = dataclasses.asdict(cfg)
    world = distributed.init()  # torchrun: join the process group (WORLD_SIZE > 1); else one process, as ever
    distributed.check_supported(cfg)
    # --- a resume is checked before anything is written
    ckpt = checkpoint.resolve(cfg.resume, run_dir)
    payload = checkpoint.load(ckpt, config, cfg.checkpoint.allow_config_change) if ckpt else None
    if distributed.is_main():  # run files are rank 0's
        checkpoint.claim_run_dir(run_dir, cfg.resume, ckpt)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").unlink(missing_ok=True)  # this run is not complete until it says so again
        OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    # --- seed and build (rank 0 first: it builds and caches the warm start the others then load)
    with distributed.main_first():
        det, tokenizer, task, ctx_len, model, sampling = build(cfg)
    r = cfg.rollout
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.use_kl_loss else None
    model.train()
    rope = rope_tables(model.config, ctx_len, det.device, det.dtype)
    # determinism=on: batch invariance proven on this device, dtype and model before step 0 (fail-closed)
    numerics = preflight.numerics_contract(det, model, ctx_len, rope)
    if distributed.is_main():
        (run_dir / "numerics.json").write_text(json.dumps(numerics, indent=1))
    engine = make_engine(cfg, model, det, ctx_len, sampling, tokenizer, run_dir)
    if world > 1:  # FSDP2 over the trainer's models; this rank's engine serves its share of each generate
        distributed.shard(model, ref_model)
        engine = RankEngine(engine, det)
    dp = distributed.DataParallel(model, ordered=det.ordered_reduce)
    # fused: one kernel for all parameters (0.22 vs 1.09 ms per step on the default model)
    o = cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(o.betas), fused=True
    )
    warmup = warmup_steps(o.lr_warmup_steps, o.lr_warmup_steps_ratio, cfg.steps)
    tags = [
        f"model={cfg.model.name}",
        f"algo={cfg.algo.name}",
        f"determinism={det_mod.label(vars(cfg.determinism))}",
        f"partial={cfg.rollout.partial.enabled}",
        f"repeat={cfg.repeat}",
    ]
    source = GroupSource(det, task, tokenizer, cfg)
    evaluator = Evaluator(cfg, source)  # eval/* every eval.every steps; reward/errors every step
    state = checkpoint.RunState(wandb_id=uuid.uuid4().hex[:8], buffer=PartialBuffer())
    if payload is not None:  # exact resume: weights, optimizer, RNGs, data position, buffer, curve
        state = checkpoint.restore(payload, model, opt, ref_model, engine.generator)
        engine.update_weights(distributed.full_state_dict(model))
        if distributed.is_main():
            checkpoint.truncate_metrics(run_dir, state.step)
            print(f"resuming from {ckpt} (step {state.step})")
    tracker = Tracker(
        run_dir,
        cfg.logger,
        run_name(cfg),
        group,
        config,
        tags=tags,
        job_type=cell_name(cfg),
        run_id=state.wandb_id,
        resume_step=state.step if payload is not None else None,
    )
    data_pos, curve, exit_code = state.data_pos, state.curve, 1
    try:
        bar = tqdm(
            range(state.step + 1, cfg.steps + 1),
            desc=run_name(cfg),
            unit="step",
            dynamic_ncols=True,
            initial=state.step,
            total=cfg.steps,
            disable=not distributed.is_main(),
        )
        for step in bar:
            t0 = time.perf_counter()
            # --- rollout -> reward -> advantage
            if r.partial.enabled:
                batch, data_pos = collect_partial(engine, source, state.buffer, step, data_pos, ctx_len)
            else:
                batch, data_pos = collect(engine, source, step, data_pos, ctx_len)
            batch = to_device(batch, det.device)
            t_rollout = time.perf_counter() - t0
            adv = ADV_ESTIMATORS[cfg.algo.adv_estimator](
                batch.scores, batch.group_ids, cfg.algo.norm_adv_by_std, cfg.algo.adv_epsilon
            )
            # --- update, then sync the engine's weights. The lr is a function of the step (verl's schedulers,
            # stepped once per rollout batch): nothing to checkpoint for an exact resume
            for g in opt.param_groups:
                g["lr"] = cfg.lr * lr_ratio(
                    step - 1, cfg.steps, warmup, o.lr_scheduler_type, o.min_lr_ratio, o.num_cycles
                )
            metrics = update(
                model, ref_model, opt, batch, adv, cfg, det.ops, ctx_len, rope, version=step - 1, dp=dp
            )
            weights = distributed.full_state_dict(model)  # gathered under FSDP2: every rank's engine gets all
            engine.update_weights(weights)
            # --- log
            metrics.update(rollout_metrics(batch, adv))
            metrics.update(batch.stats)
            metrics["fp/params"] = params_digest(weights)
            with distributed.unsharded(model):  # full parameters on every rank (FSDP2); plain models: no-op
                if distributed.is_main():  # drift.jsonl: sketches, for distances between runs
                    metrics.update(drift_step(run_dir, step, model, batch.results))
            metrics.update(layer_fingerprints(model, cfg, step))  # the modules' own forward (FSDP2 gathers)
            metrics["timing_s/rollout"] = t_rollout
            metrics["timing_s/step"] = time.perf_counter() - t0
            metrics["perf/throughput"] = float(batch.mask.sum()) / metrics["timing_s/step"]
            metrics.update(evaluator.step(step, engine))
            tracker.log(step, metrics)
            curve.append(metrics["critic/score/mean"])
            bar.set_postfix(reward=f"{curve[-1]:.3f}", step_s=f"{metrics['timing_s/step']:.2f}")
            # --- checkpoint
            state.step, state.data_pos = step, data_pos
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
                checkpoint.save(
                    run_dir, state, model, opt, ref_model, engine.generator, config, cfg.checkpoint.keep_last
                )
        if cfg.checkpoint.save_final:
            final, weights = run_dir / "checkpoint-final", distributed.full_state_dict(model)
            if distributed.is_main():
                model.save_pretrained(final, **({"state_dict": weights} if world > 1 else {}))
                tokenizer.save_pretrained(final)
        exit_code = 0
    finally:
        engine.close()
        task.close()  # its reward processes, if any (a multirun trains every job in this process)
        summary = reward_summary(curve)
        tracker.summary(summary)
        tracker.finish(exit_code)
    # written last: its presence marks a complete run for the sweep analysis
    if distributed.is_main():
        (run_dir / "summary.json").write_text(
            json.dumps(
                {"status": "complete", "run": run_name(cfg), "cell": cell_name(cfg), **summary}, indent=1
            )
        )
    distributed.barrier()
    return summary


def reward_summary(curve: list[float], window: int = 5) -> dict[str, float]:
    if not curve:
        return {}
    w = min(window, len(curve))
    return {"reward/first": sum(curve[:w]) / w, "reward/last": sum(curve[-w:]) / w, "steps": len(curve)}
