"""Exact-resume checkpoints: everything a run needs to continue bit for bit.

A checkpoint is `<run_dir>/checkpoints/step-<N>/state.pt`, written to a temp dir and renamed into place,
so a run killed mid-write leaves the previous checkpoint intact (a leftover `.tmp-*` dir is ignored, and removed
when the run resumes). `manifest.json` beside it holds every file's size and sha256: a resume verifies it and
falls back to the newest intact checkpoint (one line), or refuses when none is. `state.pt` holds tensors and
plain Python values only and is read with `torch.load(weights_only=True)`: a crafted pickle does not run.
It holds the policy, the optimizer, the reference model, every RNG state (python, numpy, torch, the
engine's stream), the data position, the partial-rollout buffer, the step, the reward curve and
the W&B run id, plus the resolved config that made it.

Under torchrun (FSDP2 models) the tensors go through torch.distributed.checkpoint instead: `step-<N>/dcp/`
holds the sharded policy, reference and optimizer (each rank writes its shards), `rng-<rank>.pt` each rank's
RNG states, and `state.pt` (rank 0) the rest, written last, before rank 0 renames the dir into place. Such a
checkpoint resumes on the same number of ranks (refused otherwise, in one line).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
import sys
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


MANIFEST = "manifest.json"


def _digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(ckpt_dir: Path) -> None:
    """Size and sha256 of every file of a checkpoint dir (written last, before the dir is renamed into place)."""
    files = sorted(p for p in Path(ckpt_dir).rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(ckpt_dir)): [p.stat().st_size, _digest(p)] for p in files}
    (Path(ckpt_dir) / MANIFEST).write_text(json.dumps({"sha256": entries}, indent=0))


def verify(ckpt_dir: Path) -> str | None:
    """None if the checkpoint's files are those its manifest lists, else what is wrong (a few words)."""
    try:
        entries = json.loads((Path(ckpt_dir) / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST}"
    for name, (size, digest) in entries.items():
        path = Path(ckpt_dir) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, the manifest says {size} (truncated?)"
        if _digest(path) != digest:
            return f"{name} does not match its sha256 (corrupt)"
    return None


def latest_intact(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies (one line for each newer one skipped); None when there is none at
    all; refused, in one line, when there are some and none is intact."""
    found = sorted(p.parent for p in checkpoint_root(run_dir).glob("step-*/state.pt"))
    bad = []
    for ckpt in reversed(found):
        problem = verify(ckpt)
        if problem is None:
            if bad:
                skipped = ", ".join(f"{n} ({w})" for n, w in bad)
                print(f"detrl: checkpoint {skipped} not intact: resuming from {ckpt.name}", file=sys.stderr)
            return ckpt
        bad.append((ckpt.name, problem))
    if bad:
        raise ConfigError(
            f"resume refused: no intact checkpoint in {checkpoint_root(run_dir)} "
            f"({'; '.join(f'{n}: {w}' for n, w in bad)}); start a new run_dir"
        )
    return None


def remove_partial(run_dir: Path) -> None:
    """Leftover temp dirs / files of writes that a kill or a full disk interrupted (they hold space)."""
    root = checkpoint_root(run_dir)
    for tmp in root.glob(".tmp-*") if root.is_dir() else []:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
    for name in STEP_LOGS:
        (Path(run_dir) / name).with_suffix(".jsonl.tmp").unlink(missing_ok=True)


def _rng(engine_generator: torch.Generator) -> dict:
    """Every RNG state as tensors and plain values (numpy's key as a list), loadable with weights_only=True."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, key.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "engine": engine_generator.get_state(),
    }


def _set_rng(rng: dict, engine_generator: torch.Generator) -> None:
    name, key, pos, has_gauss, gauss = rng["numpy"]
    random.setstate(rng["python"])
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(rng["torch"])
    engine_generator.set_state(rng["engine"])


def _buffer_plain(buffer) -> list | None:
    """The partial-rollout buffer as lists, dicts and tensors (None stays None)."""
    if buffer is None:
        return None
    out = []
    for g in buffer.groups:
        samples = []
        for s in g.samples:
            d = {**vars(s), "request": vars(s.request)}
            if s.routed_experts is not None:
                d["routed_experts"] = torch.from_numpy(np.ascontiguousarray(s.routed_experts))
            samples.append(d)
        out.append({"prompt_uid": g.prompt_uid, "answer": g.answer, "samples": samples})
    return out


def _buffer_from_plain(groups: list | None):
    from detrl.rollout.base import Request
    from detrl.rollout.partial import Group, PartialBuffer, Sample

    if groups is None:
        return None
    out = PartialBuffer()
    for g in groups:
        samples = []
        for d in g["samples"]:
            experts = d["routed_experts"]
            experts = None if experts is None else experts.numpy()
            samples.append(Sample(**{**d, "request": Request(**d["request"]), "routed_experts": experts}))
        out.groups.append(Group(g["prompt_uid"], g["answer"], samples))
    return out


def _run_plain(state: RunState) -> dict:
    return {**vars(state), "buffer": _buffer_plain(state.buffer)}


def _run_state(run: dict) -> RunState:
    return RunState(**{**run, "buffer": _buffer_from_plain(run.get("buffer"))})


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
            {"run": _run_plain(state), "config": config, "world_size": distributed.world_size(), "dcp": True},
            tmp / "state.pt",
        )
        write_manifest(tmp)
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
        "run": _run_plain(state),
        "config": config,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "ref_model": ref_model.state_dict() if ref_model is not None else None,
        "rng": _rng(engine_generator),
    }
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    _write(payload, tmp, state.step)
    final = root / f"step-{state.step:06d}"
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)  # atomic: a reader sees no checkpoint or a whole one
    for old in sorted(root.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write(payload: dict, tmp: Path, step: int) -> None:
    """state.pt and its manifest into `tmp`; a failed write (a full disk: torch's "unexpected pos") removes
    `tmp` and stops the run in one line, the previous checkpoint intact."""
    try:
        torch.save(payload, tmp / "state.pt")
        write_manifest(tmp)
    except (RuntimeError, OSError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = " ".join(str(e).split())[:200]
        raise ConfigError(
            f"checkpoint of step {step} not written (disk full?): {why}; the previous checkpoint is intact: "
            "free space, then resume=auto"
        ) from None


def resolve(resume: str | None, run_dir: Path) -> Path | None:
    """`auto`: the latest checkpoint in this run dir (None = start fresh); a path: that checkpoint or
    the latest one in that run dir (missing = error)."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_intact(run_dir)
    path = Path(resume)
    if (path / "state.pt").is_file():
        problem = verify(path)
        if problem is not None:
            raise ConfigError(
                f"resume={resume!r} refused: {problem}; name an intact checkpoint or its run dir"
            )
        return path
    found = latest_intact(path)
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
    if resume is not None:
        remove_partial(run_dir)
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


def safe_load(path: Path):
    """torch.load(weights_only=True): tensors and plain values; anything else is refused in one line."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()
        found = next((line.strip() for line in why if "GLOBAL" in line or "Unsupported" in line), "")
        raise ConfigError(
            f"resume refused: {path} holds more than tensors and plain values ({found[:160]}); "
            "it was not written by this detrl, or was tampered with"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(
            f"resume refused: cannot read {path}: {str(e).strip().splitlines()[0][:200]}"
        ) from None


def load(path: Path, config: dict, allow_config_change: bool) -> dict:
    from detrl import distributed

    payload = safe_load(Path(path) / "state.pt")
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
        _set_rng(safe_load(payload["path"] / f"rng-{distributed.rank()}.pt"), engine_generator)
        return _run_state(payload["run"])
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    if ref_model is not None and payload["ref_model"] is not None:
        ref_model.load_state_dict(payload["ref_model"])
    _set_rng(payload["rng"], engine_generator)
    return _run_state(payload["run"])


STEP_LOGS = ("metrics.jsonl", "drift.jsonl")  # per-step files that a resume truncates to its checkpoint


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Keep the per-step logs' rows up to `step` (the killed run may have logged past its last checkpoint).
    A line that is not a JSON row (a torn last write, flipped bytes) is dropped with one line saying so, the
    file as it was is kept as `<name>.corrupt`, and every valid row stays."""
    for name in STEP_LOGS:
        path = Path(run_dir) / name
        if not path.is_file():
            continue
        keep, bad = [], []
        for i, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
            try:
                row_step = json.loads(line)["step"]
                if not isinstance(row_step, int):
                    raise TypeError(row_step)
            except (ValueError, KeyError, TypeError, IndexError):
                bad += [i] if line.strip() else []
                continue
            if row_step <= step:
                keep.append(line)
        if bad:
            shutil.copyfile(path, path.with_name(f"{name}.corrupt"))
            print(
                f"detrl: {path}: line(s) {bad[:5]} are not JSON rows: left out, the {len(keep)} valid rows up to "
                f"step {step} kept (the file as it was: {name}.corrupt)",
                file=sys.stderr,
            )
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(f"{line}\n" for line in keep))
        tmp.replace(path)
