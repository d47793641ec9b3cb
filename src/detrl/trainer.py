"""The training loop: seed -> build -> for each step: rollout -> reward -> advantage -> update -> sync -> log.

Read top to bottom in `train`: each phase of a step is one function below it. The math lives in `detrl.algos`,
the update in `detrl.actor`, what determinism means in `detrl.determinism`, where the run computes in
`detrl.runtime`; the pieces are built in `detrl.builder`. This file wires them.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from detrl import actor, checkpoint, distributed, fsdp, guards
from detrl import determinism as det_mod
from detrl.actor import ActorSpec
from detrl.algos import lr_ratio, warmup_steps
from detrl.algos.advantages import StepAdvantages
from detrl.builder import build, load_policy, make_engine, sharded_build
from detrl.collect import GroupSource, StepBatch, collect, collect_partial
from detrl.config import TrainConfig
from detrl.determinism import Determinism
from detrl.device import resolve_device, to_device
from detrl.evaluate import Evaluator
from detrl.fingerprint import rollout_fingerprints
from detrl.loss_scale import LossScaler
from detrl.models import preflight
from detrl.models.forward import rope_tables
from detrl.models.hf_save import save_model
from detrl.rollout.partial import PartialBuffer
from detrl.rollout.ranks import RankEngine
from detrl.runtime import Runtime
from detrl.tracking import NUMERICS_FILE, Tracker


def cell_name(cfg: TrainConfig) -> str:
    """The sweep cell a run belongs to: everything but the replicate index."""
    partial = "on" if cfg.rollout.partial.enabled else "off"
    return f"{cfg.model.name}_{cfg.algo.name}_det-{det_mod.label(vars(cfg.determinism))}_partial-{partial}_s{cfg.seed}"


def run_name(cfg: TrainConfig) -> str:
    return f"{cell_name(cfg)}_r{cfg.repeat}"


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


@dataclass
class Run:
    """A run's parts, built once by `start`, and its live state, advanced by the phases of each step."""

    cfg: TrainConfig
    run_dir: Path
    config: dict
    world: int
    det: Determinism
    rt: Runtime
    tokenizer: Any
    task: Any
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    rope: Any
    engine: Any
    dp: distributed.DataParallel
    scaler: LossScaler
    spec: ActorSpec
    opt: torch.optim.Optimizer
    warmup: int
    source: GroupSource
    evaluator: Evaluator
    state: checkpoint.RunState
    tracker: Tracker | None = None
    kl_coef: float = 0.0  # the KL-in-reward coefficient (adaptive under kl_ctrl)


def train(cfg: TrainConfig, run_dir: Path, group: str = "default") -> dict[str, float]:
    run = start(cfg, Path(run_dir), group)
    exit_code = 1
    try:
        bar = progress_bar(run)
        for step in bar:
            t0 = time.perf_counter()
            batch = rollout(run, step)  # rollout -> reward, on the trainer's device
            t_rollout = time.perf_counter() - t0
            step_adv = StepAdvantages(cfg.algo, batch.scores, batch.group_ids, batch.mask, run.kl_coef)
            metrics = learn(run, step, batch, step_adv)  # old logprobs -> advantages -> mini-batch steps
            adv, run.kl_coef = step_adv.value, step_adv.next_kl_coef  # known once the old logprobs were
            metrics.update(step_adv.metrics)
            t_learn = time.perf_counter()
            params_fp = sync_weights(run)
            t_sync = time.perf_counter()
            metrics.update(step_metrics(run, step, batch, adv, params_fp))
            t_end = time.perf_counter()
            metrics["timing_s/rollout"] = t_rollout
            metrics["timing_s/learn"] = t_learn - t0 - t_rollout
            metrics["timing_s/sync"] = t_sync - t_learn
            metrics["timing_s/metrics"] = t_end - t_sync
            metrics["timing_s/step"] = t_end - t0
            metrics["perf/throughput"] = float(batch.mask.sum()) / metrics["timing_s/step"]
            metrics.update(run.evaluator.step(step, run.engine))
            record(run, step, metrics, bar)  # log, then checkpoint when due
        save_final(run)
        exit_code = 0
    finally:
        run.engine.close()
        run.task.close()  # its reward processes, if any (a multirun trains every job in this process)
        summary = reward_summary(run.state.curve)
        run.tracker.summary(summary)
        run.tracker.finish(exit_code)
    # written last: its presence marks a complete run for the sweep analysis
    if distributed.is_main():
        (run.run_dir / "summary.json").write_text(
            json.dumps(
                {"status": "complete", "run": run_name(cfg), "cell": cell_name(cfg), **summary}, indent=1
            )
        )
    distributed.barrier()
    return summary


def prepare(cfg: TrainConfig, run_dir: Path) -> tuple[dict, int, int, Path | None, dict | None]:
    """Join torchrun's group, pin threads, check a resume before anything is written, then claim the run dir.
    -> (config as a dict, world size, threads, checkpoint dir, its payload)."""
    config = dataclasses.asdict(cfg)
    world = distributed.init()  # torchrun: join the process group (WORLD_SIZE > 1); else one process, as ever
    threads = distributed.pin_threads(cfg.determinism.reduce == "ordered")  # a plain process's, on every rank
    distributed.check_supported(cfg)
    ckpt = checkpoint.resolve(cfg.resume, run_dir)
    payload = checkpoint.load(ckpt, config, cfg.checkpoint.allow_config_change) if ckpt else None
    if distributed.is_main():  # run files are rank 0's
        checkpoint.claim_run_dir(run_dir, cfg.resume, ckpt)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "summary.json").unlink(missing_ok=True)  # this run is not complete until it says so again
        OmegaConf.save(OmegaConf.structured(cfg), run_dir / "config.yaml")
    return config, world, threads, ckpt, payload


def build_models(cfg: TrainConfig):
    """Seed and build (rank 0 first: it builds and caches the warm start when missing; under torchrun every rank,
    rank 0 included, then loads its shards of it, as of a model.path). -> (det, tokenizer, task, runtime, policy,
    sampling)."""
    # built sharded (model.path or the warm start, under torchrun): the FSDP2 mesh before the ranks part (its
    # creation may be collective on CUDA)
    if sharded_build(cfg):
        fsdp.mesh(resolve_device(cfg.device))
    with distributed.main_first():
        det, tokenizer, task, rt, model, sampling = build(cfg)
    model.train()
    return det, tokenizer, task, rt, model, sampling


def reference(cfg: TrainConfig, tokenizer, task, rt, model, ordered: bool) -> torch.nn.Module | None:
    """The frozen reference when a KL term needs it (else None). One process: a copy of the policy. Sharded (the
    policy already is, `sharded_build`): built sharded as the policy was, from model.path or the warm start's file,
    or the seed's random init (the same bits, each rank its rows): never a full model on a rank. Draws nothing
    from the run's stream (as a copy does not)."""
    if not (cfg.algo.use_kl_loss or cfg.algo.use_kl_in_reward):
        return None
    if not distributed.is_sharded(model):
        return copy.deepcopy(model).eval().requires_grad_(False)
    return load_policy(cfg, tokenizer, task, rt.ctx_len, rt.device, ordered).eval().requires_grad_(False)


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    # fused: one kernel for all parameters (0.22 vs 1.09 ms per step on the default model)
    o = cfg.optim
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=tuple(o.betas), fused=True
    )


def start(cfg: TrainConfig, run_dir: Path, group: str) -> Run:
    """Everything before step 1: the models, the numerics preflight, the engine, the optimizer, a resume."""
    config, world, threads, ckpt, payload = prepare(cfg, run_dir)
    det, tokenizer, task, rt, model, sampling = build_models(cfg)
    rope = rope_tables(model.config, rt.ctx_len, rt.device, rt.dtype)
    # determinism=on: batch invariance proven on this device, dtype and model before step 0 (fail-closed)
    numerics = {**preflight.numerics_contract(det, rt, model, rope), "threads": threads}
    if distributed.is_main():
        (run_dir / NUMERICS_FILE).write_text(json.dumps(numerics, indent=1))
    engine = make_engine(cfg, model, det, rt, sampling, tokenizer, run_dir)
    if world > 1:  # FSDP2 over the trainer's models; this rank's engine serves its share of each generate
        # the update's passes gather each block themselves in the shards' fp32 (fsdp.Gather) and reduce its
        # gradient in its backward; compute= (bf16 gathers through FSDP2's hooks) is not used by them.
        # every init is built sharded already at W > 1 (builder.sharded_build)
        engine = RankEngine(engine, det)
    ref_model = reference(cfg, tokenizer, task, rt, model, det.ordered_reduce)
    dp = distributed.DataParallel(model, ordered=det.ordered_reduce)
    scaler = LossScaler(rt.dtype, rt.device)  # float16: dynamic loss scaling; else a no-op
    opt = make_optimizer(cfg, model)
    source = GroupSource(det, task, tokenizer, cfg)
    run = Run(
        cfg, run_dir, config, world, det, rt, tokenizer, task, model, ref_model, rope, engine, dp, scaler,
        spec=ActorSpec.from_config(cfg),  # what the update reads of the config
        opt=opt,
        warmup=warmup_steps(cfg.optim.lr_warmup_steps, cfg.optim.lr_warmup_steps_ratio, cfg.steps),
        source=source,
        evaluator=Evaluator(cfg, source),  # eval/* every eval.every steps; reward/errors every step
        state=checkpoint.RunState(wandb_id=uuid.uuid4().hex[:8], buffer=PartialBuffer()),
    )  # fmt: skip
    if payload is not None:  # exact resume: weights, optimizer, RNGs, data position, buffer, curve
        run.state = checkpoint.restore(payload, model, run.opt, ref_model, engine.generator)
        distributed.sync_weights(model, engine)
        if distributed.is_main():
            checkpoint.truncate_metrics(run_dir, run.state.step)
            print(f"resuming from {ckpt} (step {run.state.step})")
    run.tracker = make_tracker(run, group, resumed=payload is not None)
    s = run.state
    run.kl_coef = cfg.algo.kl_ctrl.kl_coef if s.kl_coef is None else s.kl_coef  # KL in the reward
    return run


def make_tracker(run: Run, group: str, resumed: bool) -> Tracker:
    cfg = run.cfg
    tags = [
        f"model={cfg.model.name}",
        f"algo={cfg.algo.name}",
        f"determinism={det_mod.label(vars(cfg.determinism))}",
        f"partial={cfg.rollout.partial.enabled}",
        f"repeat={cfg.repeat}",
    ]
    return Tracker(
        run.run_dir,
        cfg.logger,
        run_name(cfg),
        group,
        run.config,
        tags=tags,
        job_type=cell_name(cfg),
        run_id=run.state.wandb_id,
        resume_step=run.state.step if resumed else None,
    )


def progress_bar(run: Run):
    return tqdm(
        range(run.state.step + 1, run.cfg.steps + 1),
        desc=run_name(run.cfg),
        unit="step",
        dynamic_ncols=True,
        initial=run.state.step,
        total=run.cfg.steps,
        disable=not distributed.is_main(),
    )


def rollout(run: Run, step: int) -> StepBatch:
    """Generate and score this step's groups (partial rollout: resume the buffer's unfinished samples first)."""
    s, ctx_len = run.state, run.rt.ctx_len
    if run.cfg.rollout.partial.enabled:
        batch, s.data_pos = collect_partial(run.engine, run.source, s.buffer, step, s.data_pos, ctx_len)
    else:
        batch, s.data_pos = collect(run.engine, run.source, step, s.data_pos, ctx_len)
    return to_device(batch, run.rt.device)


def learn(run: Run, step: int, batch: StepBatch, step_adv: StepAdvantages) -> dict:
    """One actor update. The lr is a function of the step (verl's schedulers, stepped once per rollout batch):
    nothing to checkpoint for an exact resume."""
    cfg, o = run.cfg, run.cfg.optim
    for g in run.opt.param_groups:
        g["lr"] = cfg.lr * lr_ratio(
            step - 1, cfg.steps, run.warmup, o.lr_scheduler_type, o.min_lr_ratio, o.num_cycles
        )
    return actor.update(
        run.model,
        run.ref_model,
        run.opt,
        batch,
        step_adv,
        run.spec,
        run.rt.ops,
        run.rt.ctx_len,
        run.rope,
        version=step - 1,
        dp=run.dp,
        scaler=run.scaler,
    )


def sync_weights(run: Run) -> str:
    """The engine takes the updated policy; -> its `fp/params` digest. FSDP2: one parameter gathered at a time."""
    return distributed.sync_weights(run.model, run.engine)


def step_metrics(run: Run, step: int, batch: StepBatch, adv: torch.Tensor, params_fp: str) -> dict:
    """The rollout's metrics and fingerprints, the parameters' digest, drift sketches and layer digests."""
    metrics = {**rollout_metrics(batch, adv), **batch.stats, "fp/params": params_fp}
    metrics.update(distributed.drift(run.run_dir, step, run.model, batch.results))  # rank 0's drift.jsonl
    metrics.update(layer_fingerprints(run.model, run.cfg, step))  # the modules' own forward (FSDP2 gathers)
    return metrics


def record(run: Run, step: int, metrics: dict, bar) -> None:
    """Log the step, then checkpoint when due; SIGINT / SIGTERM wait for both, then stop (guards.Interrupted)."""
    cfg, state = run.cfg, run.state
    held = guards.hold_signals()
    run.tracker.log(step, metrics)
    state.curve.append(metrics["critic/score/mean"])
    bar.set_postfix(reward=f"{state.curve[-1]:.3f}", step_s=f"{metrics['timing_s/step']:.2f}")
    state.step, state.kl_coef = step, run.kl_coef
    last = step == cfg.steps and cfg.checkpoint.at_end
    due = (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last
    if due or held.requested:
        checkpoint.save(
            run.run_dir,
            state,
            run.model,
            run.opt,
            run.ref_model,
            run.engine.generator,
            run.config,
            cfg.checkpoint.keep_last,
        )
    held.release()  # a signal that came: stop here, this step checkpointed


def save_final(run: Run) -> None:
    """checkpoint-final/: the policy as a Hugging Face checkpoint (sharded: streamed, one parameter at a time)."""
    if run.cfg.checkpoint.save_final:
        final = run.run_dir / "checkpoint-final"
        save_model(final, run.model)
        if distributed.is_main():
            run.tokenizer.save_pretrained(final)


def reward_summary(curve: list[float], window: int = 5) -> dict[str, float]:
    if not curve:
        return {}
    w = min(window, max(1, len(curve) // 2))  # the first and last windows never overlap
    return {"reward/first": sum(curve[:w]) / w, "reward/last": sum(curve[-w:]) / w, "steps": len(curve)}
