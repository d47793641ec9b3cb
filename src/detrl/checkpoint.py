"""Exact-resume checkpoints: everything a run needs to continue bit for bit.

A checkpoint is `<run_dir>/checkpoints/step-<N>/state.pt`, written to a temp dir and renamed into place,
so a run killed mid-write leaves the previous checkpoint intact (a leftover `.tmp-*` dir is ignored).
It holds the policy, the optimizer, the reference model, every RNG state (python, numpy, torch, the
engine's stream), the data position, the partial-rollout buffer, the step, the reward curve and
the W&B run id, plus the resolved config that made it.

Under torchrun (FSDP2 models) the tensors go through torch.distributed.checkpoint instead: `step-<N>/dcp/`
holds the sharded policy, reference and optimizer (each rank writes its shards), `rng-<rank>.pt` each rank's
RNG states, and `state.pt` (rank 0) the rest, written last, before rank 0 renames the dir into place. Such a
checkpoint resumes on the same number of ranks (refused otherwise, in one line).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrl.config import ConfigError

# settings that may change across a resume without breaking equality
RESUMABLE_KEYS = ("steps", "resume", "run_dir", "checkpoint", "logger")


@dataclass
class RunState:
    step: int = 0  # last completed step
    data_pos: int = 0
    curve: list[float] = field(default_factory=list)
    wandb_id: str | None = None
    buffer: Any = None  # the partial-rollout buffer
    kl_coef: float | None = None  # the in-reward KL coefficient (algo.kl_ctrl moves it)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under a run dir, or None."""
    done = sorted(checkpoint_root(run_dir).glob("step-*/state.pt"))
    return done[-1].parent if done else None


def _rng(engine_generator: torch.Generator) -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "engine": engine_generator.get_state(),
    }


def _set_rng(rng: dict, engine_generator: torch.Generator) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    engine_generator.set_state(rng["engine"])


def _dcp_state(model, optimizer, ref_model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    m, o = get_state_dict(model, optimizer)
    return {
        "model": m,
        "optimizer": o,
        **({"ref_model": get_model_state_dict(ref_model)} if ref_model else {}),
    }


def _save_sharded(
    run_dir: Path,
    state: RunState,
    model,
    optimizer,
    ref_model,
    engine_generator,
    config: dict,
    keep_last: int,
) -> Path:
    import torch.distributed.checkpoint as dcp

    from detrl import distributed

    root, main = checkpoint_root(run_dir), distributed.is_main()
    tmp, final = root / f".tmp-step-{state.step:06d}", root / f"step-{state.step:06d}"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    distributed.barrier()
    dcp.save(_dcp_state(model, optimizer, ref_model), checkpoint_id=tmp / "dcp")
    torch.save(_rng(engine_generator), tmp / f"rng-{distributed.rank()}.pt")
    distributed.barrier()
    if main:
        torch.save(
            {"run": vars(state), "config": config, "world_size": distributed.world_size(), "dcp": True},
            tmp / "state.pt",
        )
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # atomic: a reader sees no checkpoint or a whole one
        for old in sorted(root.glob("step-*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def save(
    run_dir: Path,
    state: RunState,
    model,
    optimizer,
    ref_model,
    engine_generator: torch.Generator,
    config: dict,
    keep_last: int = 2,
) -> Path:
    from detrl import distributed

    if distributed.is_sharded(model):
        return _save_sharded(run_dir, state, model, optimizer, ref_model, engine_generator, config, keep_last)
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    payload = {
        "run": vars(state),
        "config": config,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "ref_model": ref_model.state_dict() if ref_model is not None else None,
        "rng": {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "engine": engine_generator.get_state(),
        },
    }
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    torch.save(payload, tmp / "state.pt")
    final = root / f"step-{state.step:06d}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)  # atomic: a reader sees no checkpoint or a whole one
    for old in sorted(root.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """`auto`: the latest checkpoint in this run dir (None = start fresh); a path: that checkpoint or
    the latest one in that run dir (missing = error)."""
    if resume is None:
        return None
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume)
    if (path / "state.pt").is_file():
        return path
    found = latest(path)
    if found is None:
        raise ConfigError(
            f"resume={resume!r} is not valid: no checkpoint there; use 'auto' or a run/checkpoint dir"
        )
    return found


def claim_run_dir(run_dir: Path, resume: str | None, checkpoint: Path | None) -> None:
    """Before a run writes anything: a fresh run (no `resume`) refuses a run dir that holds another run's
    metrics or checkpoints, which it would otherwise append to and leave for a later `resume=auto`.
    `resume=auto` that found no checkpoint starts clean: a killed run's rows before its first checkpoint go."""
    run_dir = Path(run_dir)
    metrics, ckpts = run_dir / "metrics.jsonl", checkpoint_root(run_dir)
    held = (metrics.is_file() and metrics.stat().st_size > 0) or any(ckpts.glob("step-*"))
    if not held or checkpoint is not None:
        return
    if resume is None:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} already holds a run (metrics.jsonl or checkpoints); "
            "pass resume=auto to continue it, or choose another run_dir"
        )
    truncate_metrics(run_dir, 0)


def _diff(a: Any, b: Any, prefix: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if not prefix and k in RESUMABLE_KEYS:
                continue
            d = _diff(a.get(k), b.get(k), f"{prefix}{k}.")
            if d:
                return d
        return None
    return None if a == b else (prefix.rstrip("."), a, b)


def load(path: Path, config: dict, allow_config_change: bool) -> dict:
    from detrl import distributed

    payload = torch.load(Path(path) / "state.pt", weights_only=False)
    payload["path"] = Path(path)
    saved, world = payload.get("world_size", 1), distributed.world_size()
    if saved != world:
        raise ConfigError(
            f"resume refused: {path} was written by {saved} rank(s), this run has {world}; "
            "resume on the same number of ranks"
        )
    d = _diff(payload["config"], config)
    if d and not allow_config_change:
        raise ConfigError(
            f"resume refused: {d[0]}={d[2]!r} differs from the checkpoint's {d[1]!r} ({path}); "
            "set checkpoint.allow_config_change=true to resume anyway"
        )
    return payload


def restore(payload: dict, model, optimizer, ref_model, engine_generator: torch.Generator) -> RunState:
    if payload.get("dcp"):  # sharded: each rank reads its shards and its own RNG states
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        from detrl import distributed

        sd = _dcp_state(model, optimizer, ref_model)
        dcp.load(sd, checkpoint_id=payload["path"] / "dcp")
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
        if ref_model is not None:
            set_model_state_dict(ref_model, sd["ref_model"])
        _set_rng(
            torch.load(payload["path"] / f"rng-{distributed.rank()}.pt", weights_only=False), engine_generator
        )
        return RunState(**payload["run"])
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if ref_model is not None and payload["ref_model"] is not None:
        ref_model.load_state_dict(payload["ref_model"])
    rng = payload["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    engine_generator.set_state(rng["engine"])
    return RunState(**payload["run"])


STEP_LOGS = ("metrics.jsonl", "drift.jsonl")  # per-step files that a resume truncates to its checkpoint


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the per-step logs' rows up to `step` (the killed run may have logged past its last checkpoint)."""
    import json

    for name in STEP_LOGS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError):
                break
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in keep))
        tmp.replace(path)
