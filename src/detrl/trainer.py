"""The training loop: seed -> build -> for each step: rollout -> reward -> advantage -> update -> log.

Read top to bottom in `train`. The math lives in `detrl.algos`; what determinism means lives in
`detrl.determinism`; this file wires them.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import json
import time
import uuid
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from detrl import checkpoint
from detrl import determinism as det_mod
from detrl.algos import ADV_ESTIMATORS, agg_loss, compute_policy_loss, kl_penalty
from detrl.algos.core import entropy_from_logp, masked_mean
from detrl.collect import GroupSource, StepBatch, collect, collect_partial
from detrl.config import TrainConfig
from detrl.data import ArithmeticTask, build_tokenizer
from detrl.fingerprint import drift_step, params_digest, rollout_fingerprints
from detrl.models.build import build_model
from detrl.models.forward import forward, rope_tables, token_logprobs
from detrl.rollout import EmbeddedEngine, SamplingParams
from detrl.rollout.partial import PartialBuffer
from detrl.tracking import Tracker
from detrl.warmstart import encode, load_or_build


def context_length(task: ArithmeticTask, tokenizer, max_new_tokens: int) -> int:
    """The fixed key length shared by sampler and trainer: longest prompt + new tokens, rounded up to 8."""
    longest = max(len(encode(tokenizer, task[i].prompt)) for i in range(len(task)))
    return -(-(longest + max_new_tokens) // 8) * 8


def cell_name(cfg: TrainConfig) -> str:
    """The sweep cell a run belongs to: everything but the replicate index."""
    partial = "on" if cfg.rollout.partial.enabled else "off"
    return f"{cfg.model.name}_{cfg.algo.name}_det-{cfg.determinism.name}_partial-{partial}_s{cfg.seed}"


def run_name(cfg: TrainConfig) -> str:
    return f"{cell_name(cfg)}_r{cfg.repeat}"


def load_policy(cfg: TrainConfig, tokenizer, task, ctx_len: int) -> torch.nn.Module:
    if cfg.model.path is None and cfg.model.init == "warmstart":
        return load_or_build(cfg.model, cfg.data, cfg.warmstart, tokenizer, task, ctx_len)
    return build_model(cfg.model, seed=cfg.seed)


def sequence_logprobs(model, input_ids, ops, ctx_len, rope, temperature):
    """Trainer logprobs of each next token [N, L-1] and the full log-distributions [N, L-1, V]."""
    logits = forward(model, input_ids, ops, ctx_len, rope)  # [N, L, V]
    return token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


def update(model, ref_model, opt, batch: StepBatch, adv: torch.Tensor, cfg: TrainConfig, ops, ctx_len, rope,
           version: int):
    """One optimizer step over the batch, in micro-batches with global denominators. -> metrics."""
    a, temp = cfg.algo, cfg.rollout.temperature
    n = batch.input_ids.shape[0]
    stale_tokens = cfg.rollout.partial.stale_tokens
    train_mask = batch.mask * (batch.versions == version) if stale_tokens == "mask" else batch.mask
    global_tokens, global_seqs = train_mask.sum().clamp_min(1.0), (train_mask.sum(-1) > 0).sum()
    sums = dict.fromkeys(["pg_loss", "kl_loss", "entropy", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"], 0.0)
    diffs, k3s, pdiffs = [], [], []
    opt.zero_grad(set_to_none=True)
    for lo in range(0, n, cfg.micro_batch_size):
        sl = slice(lo, lo + cfg.micro_batch_size)
        ids, mask = batch.input_ids[sl], batch.mask[sl]
        fresh = (batch.versions[sl] == version).float() * mask  # tokens sampled by the current weights
        logp, logp_full = sequence_logprobs(model, ids, ops, ctx_len, rope, temp)  # [n, L-1], [n, L-1, V]
        tok_adv = adv[sl, None].expand_as(logp)  # [n, L-1]
        # one update per rollout batch: for fresh tokens the old policy is this policy (ratio 1). Stale
        # tokens of a partial rollout: keep = importance ratio against the behaviour logprobs (PPO clip),
        # rescore = the current policy re-scores them (ratio 1), mask = left out of the loss
        old = logp.detach()
        if stale_tokens == "keep":
            old = torch.where(fresh > 0, old, batch.rollout_logp[sl])
        elif stale_tokens == "mask":
            mask = fresh
        share = mask.sum() / global_tokens
        pg, m = compute_policy_loss(logp, old, tok_adv, mask, a.clip_ratio_low, a.clip_ratio_high, a.clip_ratio_c)
        agg = dict(mode=a.loss_agg_mode, global_tokens=global_tokens, global_seqs=global_seqs,
                   max_len=cfg.rollout.max_new_tokens)
        loss = agg_loss(pg, mask, **agg)
        sums["pg_loss"] += loss.item()
        if ref_model is not None:
            with torch.no_grad():
                ref_logp, _ = sequence_logprobs(ref_model, ids, ops, ctx_len, rope, temp)
            kl = agg_loss(kl_penalty(logp, ref_logp, a.kl_loss_type), mask, **agg)
            loss = loss + a.kl_loss_coef * kl
            sums["kl_loss"] += kl.item()
        ent = entropy_from_logp(logp_full)  # [n, L-1]
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * agg_loss(ent, mask, **agg)
        loss.backward()
        sums["entropy"] += (masked_mean(ent.detach(), mask) * share).item()
        for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
            sums[k] += (m[k] * share).item()
        # trainer vs rollout on the tokens the current weights sampled: exactly 0 is true on-policy
        d = (logp.detach() - batch.rollout_logp[sl])[fresh > 0]
        diffs.append(d.abs())
        k3s.append(torch.expm1(-d) + d)  # k3 of the rollout policy against the trainer's
        pdiffs.append((logp.detach().exp() - batch.rollout_logp[sl].exp())[fresh > 0].abs())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    d, k3, pd = (torch.cat(x) if sum(t.numel() for t in x) else torch.zeros(1) for x in (diffs, k3s, pdiffs))
    return {
        **{f"actor/{k}": v for k, v in sums.items()},
        "actor/grad_norm": grad_norm.item(),
        "actor/lr": opt.param_groups[0]["lr"],
        "mismatch/train_rollout_logprob_abs_diff": d.mean().item(),
        "mismatch/train_rollout_logprob_abs_diff_max": d.max().item(),
        "mismatch/k3_kl": k3.mean().item(),
        "mismatch/max_prob_diff": pd.max().item(),
    }


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
        "response_length/clip_ratio": sum(r.finish_reason == "length" for r in batch.results) / len(batch.results),
        "prompt_length/mean": sum(len(r.request.prompt_ids) for r in batch.results) / len(batch.results),
        "overlong/penalty_mean": (batch.scores - batch.correct).mean().item(),
        "dapo/kept_groups": batch.kept_groups,
        "dapo/gen_batches": batch.gen_rounds,
        **rollout_fingerprints(batch.results),  # content digests keyed by (uid, sample), and the order apart
    }


def build(cfg: TrainConfig):
    """Seed, then the pieces every entrypoint needs: (determinism, tokenizer, task, ctx_len, policy, sampling)."""
    det = det_mod.setup(cfg.determinism.enabled, cfg.seed)
    tokenizer = build_tokenizer()
    task = ArithmeticTask(cfg.data.min_operand, cfg.data.max_operand, list(cfg.data.ops), seed=cfg.seed)
    r = cfg.rollout
    ctx_len = context_length(task, tokenizer, r.max_new_tokens)
    model = load_policy(cfg, tokenizer, task, ctx_len)
    if model.config.vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size={model.config.vocab_size} < tokenizer size {len(tokenizer)}")
    sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens, (tokenizer.eos_token_id,))
    return det, tokenizer, task, ctx_len, model, sampling


def make_engine(cfg: TrainConfig, model, det, ctx_len: int, sampling: SamplingParams, tokenizer, run_dir: Path):
    """The rollout engine of `rollout.backend`, holding the current policy weights."""
    r = cfg.rollout
    if r.backend == "sglang":
        from detrl.rollout.sglang import SGLangEngine
        from detrl.rollout.sglang_launch import launch, server_argv, sglang_version

        s, urls, procs = r.sglang, list(r.sglang.urls), []
        if not urls:  # launch our own servers from the current policy
            sglang_version()  # one line telling how to install it, if it is not
            init = run_dir / "sglang-init"
            model.save_pretrained(init)
            tokenizer.save_pretrained(init)
            for i in range(s.num_servers):
                argv = server_argv(str(init), s.port + i, cfg.seed, det.enabled, s.attention_backend, s.tp_size,
                                   s.rl_on_policy_target)
                procs.append(launch(argv, run_dir / f"sglang-{i}.log", s.gpu_ids[i] if i < len(s.gpu_ids) else None))
                urls.append(f"http://127.0.0.1:{s.port + i}")
        if procs:
            atexit.register(lambda: [p.terminate() for p in procs if p.poll() is None])  # even if we crash early
        engine = SGLangEngine(urls, sampling, det.fixed_routing, r.max_batch_size, timeout_s=s.timeout_s,
                              retries=s.retries, health_timeout_s=s.health_timeout_s, procs=procs)
        engine.update_weights(model.state_dict())  # the servers start from the policy
        return engine
    return EmbeddedEngine(model, det.ops, ctx_len, sampling, seed=cfg.seed, num_workers=r.num_workers,
                          max_batch_size=r.max_batch_size, fixed_routing=det.fixed_routing)


def train(cfg: TrainConfig, run_dir: Path, group: str = "default") -> dict[str, float]:
    run_dir = Path(run_dir)
    config = dataclasses.asdict(cfg)
    # --- a resume is checked before anything is written
    ckpt = checkpoint.resolve(cfg.resume, run_dir)
    payload = checkpoint.load(ckpt, config, cfg.checkpoint.allow_config_change) if ckpt else None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").unlink(missing_ok=True)  # this run is not complete until it says so again
    OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    # --- seed and build
    det, tokenizer, task, ctx_len, model, sampling = build(cfg)
    r = cfg.rollout
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.algo.use_kl_loss else None
    model.train()
    rope = rope_tables(model.config, ctx_len)
    engine = make_engine(cfg, model, det, ctx_len, sampling, tokenizer, run_dir)
    # fused: one kernel for all parameters (0.22 vs 1.09 ms per step on the default model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99),
                            fused=True)
    tags = [f"model={cfg.model.name}", f"algo={cfg.algo.name}", f"determinism={cfg.determinism.name}",
            f"partial={cfg.rollout.partial.enabled}", f"repeat={cfg.repeat}"]
    source = GroupSource(det, task, tokenizer, cfg)
    state = checkpoint.RunState(wandb_id=uuid.uuid4().hex[:8], buffer=PartialBuffer())
    if payload is not None:  # exact resume: weights, optimizer, RNGs, data position, buffer, curve
        state = checkpoint.restore(payload, model, opt, ref_model, engine.generator)
        engine.update_weights(model.state_dict())
        checkpoint.truncate_metrics(run_dir, state.step)
        print(f"resuming from {ckpt} (step {state.step})")
    tracker = Tracker(run_dir, cfg.logger, run_name(cfg), group, config, tags=tags, job_type=cell_name(cfg),
                      run_id=state.wandb_id)
    data_pos, curve, exit_code = state.data_pos, state.curve, 1
    try:
        bar = tqdm(range(state.step + 1, cfg.steps + 1), desc=run_name(cfg), unit="step", dynamic_ncols=True,
                   initial=state.step, total=cfg.steps)
        for step in bar:
            t0 = time.perf_counter()
            # --- rollout -> reward -> advantage
            if r.partial.enabled:
                batch, data_pos = collect_partial(engine, source, state.buffer, step, data_pos, ctx_len)
            else:
                batch, data_pos = collect(engine, source, step, data_pos, ctx_len)
            t_rollout = time.perf_counter() - t0
            adv = ADV_ESTIMATORS[cfg.algo.adv_estimator](batch.scores, batch.group_ids, cfg.algo.norm_adv_by_std,
                                                         cfg.algo.adv_epsilon)
            # --- update, then sync the engine's weights
            metrics = update(model, ref_model, opt, batch, adv, cfg, det.ops, ctx_len, rope, version=step - 1)
            engine.update_weights(model.state_dict())
            # --- log
            metrics.update(rollout_metrics(batch, adv))
            metrics.update(batch.stats)
            metrics["fp/params"] = params_digest(model)
            metrics.update(drift_step(run_dir, step, model, batch.results))  # drift.jsonl: sketches, for distances
            metrics["timing_s/rollout"] = t_rollout
            metrics["timing_s/step"] = time.perf_counter() - t0
            metrics["perf/throughput"] = float(batch.mask.sum()) / metrics["timing_s/step"]
            tracker.log(step, metrics)
            curve.append(metrics["critic/score/mean"])
            bar.set_postfix(reward=f"{curve[-1]:.3f}", step_s=f"{metrics['timing_s/step']:.2f}")
            # --- checkpoint
            state.step, state.data_pos = step, data_pos
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or step == cfg.steps:
                checkpoint.save(run_dir, state, model, opt, ref_model, engine.generator, config,
                                cfg.checkpoint.keep_last)
        if cfg.checkpoint.save_final:
            final = run_dir / "checkpoint-final"
            model.save_pretrained(final)
            tokenizer.save_pretrained(final)
        exit_code = 0
    finally:
        engine.close()
        summary = reward_summary(curve)
        tracker.summary(summary)
        tracker.finish(exit_code)
    # written last: its presence marks a complete run for the sweep analysis
    (run_dir / "summary.json").write_text(json.dumps({"status": "complete", "run": run_name(cfg),
                                                      "cell": cell_name(cfg), **summary}, indent=1))
    return summary


def reward_summary(curve: list[float], window: int = 5) -> dict[str, float]:
    if not curve:
        return {}
    w = min(window, len(curve))
    return {"reward/first": sum(curve[:w]) / w, "reward/last": sum(curve[-w:]) / w, "steps": len(curve)}
