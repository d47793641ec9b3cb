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

from detrl import actor, checkpoint, distributed, guards, plan
from detrl import determinism as det_mod
from detrl.actor import ActorSpec
from detrl.algos import lr_ratio, warmup_steps
from detrl.algos.advantages import StepAdvantages
from detrl.collect import GroupSource, StepBatch, collect, collect_partial
from detrl.config import ConfigError, TrainConfig
from detrl.data import build_task, stop_token_ids, tokenizer_for
from detrl.device import check_compute_dtype, resolve_device, resolve_dtype, to_device
from detrl.evaluate import Evaluator
from detrl.fingerprint import rollout_fingerprints
from detrl.loss_scale import LossScaler
from detrl.models import preflight
from detrl.models.build import build_model, checkpoint_architecture
from detrl.models.forward import rope_tables
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
        device = resolve_device(cfg.device).type
        return load_or_build(cfg.model, cfg.data, cfg.warmstart, tokenizer, task, ctx_len, device)
    return build_model(cfg.model, seed=cfg.seed)


def update(
    model,
    ref_model,
    opt,
    batch: StepBatch,
    adv,
    cfg: TrainConfig,
    ops,
    ctx_len,
    rope,
    version: int,
    dp: distributed.DataParallel | None = None,
    scaler: LossScaler | None = None,
):
    """`detrl.actor.update` for callers holding a TrainConfig (tests, benchmarks): the spec built from it, and
    one process's DataParallel unless one is given. `train` builds its spec once and calls the actor."""
    dp = dp if dp is not None else distributed.DataParallel(model, ordered=True)
    spec = ActorSpec.from_config(cfg)
    return actor.update(model, ref_model, opt, batch, adv, spec, ops, ctx_len, rope, version, dp, scaler)


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
    adv = (
        adv[batch.mask > 0] if adv.dim() == 2 else adv
    )  # token advantages: over the response tokens, as verl
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
    check_compute_dtype(det.device, det.dtype, det.invariant_kernels)  # float16 on CPU: not under on
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
    # the memory plan, before the model exists: a run that cannot fit is refused in one line
    plan.require_fits(cfg, ctx_len, distributed.world_size(), det.device)
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
        from detrl.rollout.sglang.launch import launch, server_argv, sglang_dtype, sglang_version

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
    threads = distributed.pin_threads(cfg.determinism.reduce == "ordered")  # a plain process's, on every rank
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
    use_ref = cfg.algo.use_kl_loss or cfg.algo.use_kl_in_reward
    ref_model = copy.deepcopy(model).eval().requires_grad_(False) if use_ref else None
    model.train()
    rope = rope_tables(model.config, ctx_len, det.device, det.dtype)
    # determinism=on: batch invariance proven on this device, dtype and model before step 0 (fail-closed)
    numerics = {**preflight.numerics_contract(det, model, ctx_len, rope), "threads": threads}
    if distributed.is_main():
        (run_dir / "numerics.json").write_text(json.dumps(numerics, indent=1))
    engine = make_engine(cfg, model, det, ctx_len, sampling, tokenizer, run_dir)
    if world > 1:  # FSDP2 over the trainer's models; this rank's engine serves its share of each generate
        distributed.shard(model, ref_model, compute=det.dtype, ordered=det.ordered_reduce)
        engine = RankEngine(engine, det)
    dp = distributed.DataParallel(model, ordered=det.ordered_reduce)
    scaler = LossScaler(det.dtype, det.device)  # float16: dynamic loss scaling; else a no-op
    spec = ActorSpec.from_config(cfg)  # what the update reads of the config
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
        distributed.sync_weights(model, engine)
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
    kl_coef = cfg.algo.kl_ctrl.kl_coef if state.kl_coef is None else state.kl_coef  # KL in the reward
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
            step_adv = StepAdvantages(cfg.algo, batch.scores, batch.group_ids, batch.mask, kl_coef)
            # --- update, then sync the engine's weights. The lr is a function of the step (verl's schedulers,
            # stepped once per rollout batch): nothing to checkpoint for an exact resume
            for g in opt.param_groups:
                g["lr"] = cfg.lr * lr_ratio(
                    step - 1, cfg.steps, warmup, o.lr_scheduler_type, o.min_lr_ratio, o.num_cycles
                )
            metrics = actor.update(
                model,
                ref_model,
                opt,
                batch,
                step_adv,
                spec,
                det.ops,
                ctx_len,
                rope,
                version=step - 1,
                dp=dp,
                scaler=scaler,
            )
            adv, kl_coef = step_adv.value, step_adv.next_kl_coef  # computed once the old logprobs were known
            metrics.update(step_adv.metrics)
            params_fp = distributed.sync_weights(model, engine)  # FSDP2: one parameter gathered at a time
            # --- log
            metrics.update(rollout_metrics(batch, adv))
            metrics.update(batch.stats)
            metrics["fp/params"] = params_fp
            metrics.update(distributed.drift(run_dir, step, model, batch.results))  # rank 0's drift.jsonl
            metrics.update(layer_fingerprints(model, cfg, step))  # the modules' own forward (FSDP2 gathers)
            metrics["timing_s/rollout"] = t_rollout
            metrics["timing_s/step"] = time.perf_counter() - t0
            metrics["perf/throughput"] = float(batch.mask.sum()) / metrics["timing_s/step"]
            metrics.update(evaluator.step(step, engine))
            held = guards.hold_signals()  # SIGINT / SIGTERM wait for this step's log and checkpoint
            tracker.log(step, metrics)
            curve.append(metrics["critic/score/mean"])
            bar.set_postfix(reward=f"{curve[-1]:.3f}", step_s=f"{metrics['timing_s/step']:.2f}")
            # --- checkpoint
            state.step, state.data_pos, state.kl_coef = step, data_pos, kl_coef
            last = step == cfg.steps and cfg.checkpoint.at_end
            due = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last
            if due or held.requested:
                checkpoint.save(
                    run_dir, state, model, opt, ref_model, engine.generator, config, cfg.checkpoint.keep_last
                )
            held.release()  # a signal that came: stop here (guards.Interrupted), this step checkpointed
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
    w = min(window, max(1, len(curve) // 2))  # the first and last windows never overlap
    return {"reward/first": sum(curve[:w]) / w, "reward/last": sum(curve[-w:]) / w, "steps": len(curve)}
