"""Probe the engine for the sources of rollout nondeterminism, one cause per row.

    python -m detrl.probe model=qwen3_moe trials=50
    python -m detrl.probe device=cuda model=qwen3_0p6b trials=50     # the CUDA engine, its op sets, bf16

The same target prompts go through one engine batch `trials` times; per row and batch-mate mode it
prints how many distinct outputs (token sequences, and token + logprob bit patterns) a target got, worst
of the targets. Each row lets exactly one thing vary between trials:

| row | batch-mates | sampling noise | kernels | what it isolates |
|---|---|---|---|---|
| control | fixed | shared stream, reseeded alike each trial | default | nothing varies: must be 1 |
| stream advance | fixed | shared stream, continuing across trials | batch-invariant | where the stream stands when the batch runs |
| batch composition | vary | shared stream, reseeded alike each trial | batch-invariant | which slot of the stream's draws the target gets |
| kernels | vary | per-sample seeds | default | the kernels' row results depending on batch-mates |
| determinism=on | vary | per-sample seeds | batch-invariant | all pinned: must be 1 |

Batch-mate modes (columns): `single` (copies of the target), `mixed` (random other prompts), `prefix`
(prompts sharing a prefix with the target); batch sizes 1..max_bs, the target at a random slot. "fixed"
rows use one batch of the mode for every trial. The config's `determinism` does not matter here: every
row sets its own sampling and kernels.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass

import hydra
import torch
from omegaconf import DictConfig

from detrl.config import ConfigError, TrainConfig, register_configs, to_typed
from detrl.models.ops import select_ops
from detrl.rollout import EmbeddedEngine, Request

MODES = ("single", "mixed", "prefix")


@dataclass(frozen=True)
class Row:
    mates: str  # "fixed": the same batch every trial | "vary": new batch-mates, size and slot each trial
    sampling: (
        str  # "reseeded": shared stream, reseeded alike per trial | "advancing": shared stream, not reseeded
    )
    #                | "seeded": per-sample seeds
    kernels: str  # "default" | "batch_invariant"


ROWS = {
    "control": Row("fixed", "reseeded", "default"),
    "stream advance": Row("fixed", "advancing", "batch_invariant"),
    "batch composition": Row("vary", "reseeded", "batch_invariant"),
    "kernels": Row("vary", "seeded", "default"),
    "determinism=on": Row("vary", "seeded", "batch_invariant"),
}


def _batch(
    mode: str, target: Request, pool: list[tuple[int, ...]], size: int, rng: random.Random, seeded: bool
) -> tuple[list[Request], int]:
    """One batch of `size` holding `target` once at a random slot; -> (batch, the target's slot)."""
    if mode == "single":
        others = [target.prompt_ids] * (size - 1)
    elif mode == "mixed":
        others = [rng.choice(pool) for _ in range(size - 1)]
    else:  # prefix: the target's prompt cut short and completed with another prompt's tail
        cut = rng.randint(1, len(target.prompt_ids) - 1)
        others = [
            target.prompt_ids[:cut] + rng.choice(pool)[cut:] or target.prompt_ids for _ in range(size - 1)
        ]
    batch = [
        dataclasses.replace(
            target,
            prompt_uid=target.prompt_uid + 1 + i,
            prompt_ids=ids,
            seed=rng.getrandbits(62) if seeded else None,
        )
        for i, ids in enumerate(others)
    ]
    pos = rng.randint(0, len(batch))
    batch.insert(pos, target)
    return batch, pos


def _engines(cfg: TrainConfig, rt, model, params, max_bs: int) -> dict:
    """One engine per kernel set, on the run's device: the default set is the `off` preset's ops for that device,
    the batch-invariant one the `on` preset's (CPU: the embedded engine, one worker; CUDA: the CUDA engine)."""

    def ops(kernels: str):
        on = kernels == "batch_invariant"
        return select_ops(rt.device.type, on, on, rt.dtype, rt.ops.checkpoint)

    if rt.cuda:
        from detrl.rollout.cuda import CudaEngine

        return {
            k: CudaEngine(
                model,
                ops(k),
                rt.ctx_len,
                params,
                seed=cfg.seed,
                max_batch_size=max_bs,
                device=rt.device,
                dtype=rt.dtype,
                compile=k == "default",
            )
            for k in ("default", "batch_invariant")
        }
    return {
        k: EmbeddedEngine(
            model, ops(k), rt.ctx_len, params, seed=cfg.seed, num_workers=1, max_batch_size=max_bs
        )
        for k in ("default", "batch_invariant")
    }


def _reseed(engine, seed: int) -> None:
    """Set the stream unseeded requests draw from: the embedded sampler's generator, or CUDA's (the CUDA engine
    samples unseeded rows from the device's global stream)."""
    if isinstance(engine, EmbeddedEngine):
        engine.sampler.generator.manual_seed(seed)
    else:
        torch.cuda.manual_seed(seed)


def probe(
    cfg: TrainConfig, trials: int, targets: int = 3, max_bs: int = 24, rows: dict[str, Row] | None = None
) -> dict[str, dict[str, tuple[int, int]]]:
    """-> {row: {mode: (max distinct token outputs, max distinct token+logprob outputs)}} over the targets."""
    from detrl.builder import build
    from detrl.determinism import stable_hash
    from detrl.warmstart import encode

    rows = ROWS if rows is None else rows
    det, tokenizer, task, rt, model, params = build(cfg)
    engines = _engines(cfg, rt, model, params, max_bs)
    pool = [tuple(encode(tokenizer, task[i].prompt)) for i in range(len(task))]
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    out: dict[str, dict[str, tuple[int, int]]] = {}
    try:
        for row_name, row in rows.items():
            engine = engines[row.kernels]
            torch.use_deterministic_algorithms(
                row.kernels == "batch_invariant"
            )  # the preset of the kernels: on or off
            seeded = row.sampling == "seeded"
            out[row_name] = {}
            for mode in MODES:
                worst = (0, 0)
                for j in range(targets):
                    seed = stable_hash("probe", cfg.seed, j) if seeded else None
                    target = Request(det.prompt_uid(j) * 1000, 0, pool[j], seed)
                    rng = random.Random(stable_hash("probe-mates", cfg.seed, mode, j))
                    stream_seed = stable_hash("probe-stream", cfg.seed, j)
                    _reseed(engine, stream_seed)
                    fixed = (
                        _batch(mode, target, pool, 1 + max_bs // 2, rng, seeded)
                        if row.mates == "fixed"
                        else None
                    )
                    outs = []
                    for t in range(trials):
                        batch, pos = fixed or _batch(mode, target, pool, 1 + t % max_bs, rng, seeded)
                        if row.sampling == "reseeded":
                            _reseed(engine, stream_seed)
                        res = engine.run_batch(batch)[pos]
                        outs.append((tuple(res.tokens), tuple(res.logprobs)))
                    worst = max(worst[0], len({o[0] for o in outs})), max(worst[1], len(set(outs)))
                out[row_name][mode] = worst
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        for e in engines.values():
            e.close()
    return out


def format_table(counts: dict[str, dict[str, tuple[int, int]]], trials: int, label: str = "") -> str:
    lines = [
        f"| {label or 'row'} | batch-mates | sampling noise | kernels | {' | '.join(MODES)} |",
        "|---|---|---|---|" + "---|" * len(MODES),
    ]
    sampling = {
        "reseeded": "shared stream, reseeded per trial",
        "advancing": "shared stream, advancing",
        "seeded": "per-sample seeds",
    }
    for name, by_mode in counts.items():
        row = ROWS.get(name)
        desc = [row.mates, sampling[row.sampling], row.kernels.replace("_", "-")] if row else ["", "", ""]
        lines.append(
            f"| {name} | "
            + " | ".join(desc)
            + " | "
            + " | ".join(f"{by_mode[m][0]} / {by_mode[m][1]}" for m in MODES)
            + " |"
        )
    return (
        f"distinct outputs of a target over {trials} trials, tokens / tokens+logprobs (worst of 3 targets; "
        "1 = deterministic)\n" + "\n".join(lines)
    )


register_configs()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="probe")
def main(cfg: DictConfig) -> None:
    try:
        typed = to_typed(cfg)
    except (ConfigError, ValueError) as e:
        print(f"detrl.probe: config error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    label = f"{typed.model.name} ({typed.device})" if typed.device != "auto" else typed.model.name
    print(format_table(probe(typed, typed.trials), typed.trials, label=label))


if __name__ == "__main__":
    main()
