"""The pieces every entrypoint builds from a config, once: seed and determinism, the runtime (device, dtype, op
set), tokenizer, task, policy, sampling params, and the rollout engine."""

from __future__ import annotations

import atexit
from pathlib import Path

import torch

from detrl import determinism as det_mod
from detrl import distributed, plan, runtime
from detrl.config import ConfigError, TrainConfig
from detrl.data import build_task, stop_token_ids, tokenizer_for
from detrl.device import check_compute_dtype, resolve_device, resolve_dtype
from detrl.models.build import build_model, checkpoint_architecture
from detrl.rollout import SamplingParams
from detrl.runtime import context_length
from detrl.warmstart import build_and_cache, is_cached, load_or_build, warmstart_dir


def checkpoint_dir(cfg: TrainConfig, tokenizer) -> Path | None:
    """The Hugging Face directory the run's weights come from (`ModelConfig.from_checkpoint`): model.path, or the
    warm start's cache (model.init=warmstart, no path; not built yet on a first run); None for a random init."""
    m = cfg.model
    if not m.from_checkpoint():
        return None
    if m.path is not None:
        return Path(m.path)
    return warmstart_dir(m, cfg.data, cfg.warmstart, tokenizer, resolve_device(cfg.device).type)


def sharded_build(cfg: TrainConfig) -> bool:
    """Whether the policy (and reference) are built sharded: under torchrun with W > 1, every init: from
    `checkpoint_dir` (model.path or the warm start's cache, `models.sharded_load`) or the seed's random init
    (`models.sharded_init`: each rank materialises only its rows, the full build's bits); a one-rank run builds in
    full as ever."""
    return plan.builds_sharded(distributed.world_size())


def load_sharded_policy(
    cfg: TrainConfig, tokenizer, task, ctx_len: int, device: torch.device | None, ordered: bool
) -> torch.nn.Module:
    """`checkpoint_dir`'s model, FSDP2-sharded on `device`, each rank's rows read from the file (collective-free).
    The warm start is built and cached first when missing (rank 0, under `distributed.main_first`: its full
    model dropped), so that every rank, rank 0 included, loads the same shards of the same file. A random init
    (no checkpoint dir): `init_sharded`, each rank's rows of build_model(cfg.model, cfg.seed)."""
    from detrl.models.sharded_init import init_sharded
    from detrl.models.sharded_load import load_sharded

    path = checkpoint_dir(cfg, tokenizer)
    if (
        path is None
    ):  # model.init=random: draws from its own seeded stream (under fork_rng), as build_model does
        return init_sharded(cfg.model, cfg.seed, device or torch.device("cpu"), ordered)
    if cfg.model.path is None and not is_cached(path):  # the warm start, missing: built as one rank builds it
        device_type = resolve_device(cfg.device).type
        build_and_cache(path, cfg.model, cfg.warmstart, tokenizer, task, ctx_len, device_type)
    with torch.random.fork_rng(devices=[]):  # draws nothing from the run's stream
        return load_sharded(
            path, device or torch.device("cpu"), ordered, attn_implementation=cfg.model.attn_implementation
        )


def load_policy(
    cfg: TrainConfig, tokenizer, task, ctx_len: int, device: torch.device | None = None, ordered: bool = True
) -> torch.nn.Module:
    """model.path's weights (float32), the cached warm start (arithmetic), or a fresh model from the seed. Under
    `sharded_build`: FSDP2-sharded on `device` (`load_sharded_policy`: from `checkpoint_dir`, in eval mode as
    from_pretrained leaves a model; or the random init's rows); else a full model on CPU."""
    if sharded_build(cfg):
        return load_sharded_policy(cfg, tokenizer, task, ctx_len, device, ordered)
    if cfg.model.path is None and cfg.model.init == "warmstart":
        device = resolve_device(cfg.device).type
        return load_or_build(cfg.model, cfg.data, cfg.warmstart, tokenizer, task, ctx_len, device)
    return build_model(cfg.model, seed=cfg.seed)


def build(cfg: TrainConfig):
    """Seed, then the pieces every entrypoint needs: (determinism, tokenizer, task, runtime, policy, sampling)."""
    device = resolve_device(cfg.device)
    det = det_mod.setup(cfg.determinism, cfg.seed)
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_compute_dtype(
        device, dtype, det.invariant_kernels
    )  # float16 on CPU / float32 on CUDA: not under on
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
    rt = runtime.make(det, device, dtype, cfg.activation_checkpointing, ctx_len)
    # the memory plan, before the model exists: a run that cannot fit is refused in one line
    plan.require_fits(cfg, ctx_len, distributed.world_size(), rt.device)
    # float32 master weights (sharded under torchrun: from model.path, the warm start's file or the seed; else full)
    model = load_policy(cfg, tokenizer, task, ctx_len, rt.device, det.ordered_reduce)
    if not distributed.is_sharded(model):  # (a sharded one is on rt.device already)
        model = model.to(rt.device)
    if model.config.vocab_size < len(tokenizer):
        raise ConfigError(
            f"model.vocab_size={model.config.vocab_size} < the tokenizer's {len(tokenizer)} tokens"
        )
    sampling = SamplingParams(
        r.temperature, r.top_p, r.max_new_tokens, stop_token_ids(tokenizer, cfg.model.path)
    )
    return det, tokenizer, task, rt, model, sampling


def make_engine(cfg: TrainConfig, model, det, rt, sampling: SamplingParams, tokenizer, run_dir: Path):
    """The rollout engine of `rollout.backend`, holding the current policy weights."""
    r = cfg.rollout
    if r.backend == "sglang":
        from detrl.rollout.sglang import SGLangEngine
        from detrl.rollout.sglang.launch import launch, server_argv, sglang_dtype, sglang_version

        s, urls, procs = r.sglang, list(r.sglang.urls), []
        dtype = rt.dtype  # served in the trainer's compute dtype (bf16 on GPUs), not its fp32 masters'
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
    if rt.cuda and cfg.algo.routing_replay:
        raise ConfigError(
            f"algo.routing_replay=True is not valid: the CUDA engine (device={rt.device.type}) "
            "does not record expert ids (use device=cpu)"
        )
    from detrl.rollout.registry import build_engine

    engine = build_engine("embedded", rt.device.type, model, det, rt, sampling, cfg.seed, r)
    if distributed.is_sharded(model):  # built empty from the shapes: filled one gathered parameter at a time
        distributed.sync_weights(model, engine)
    return engine
