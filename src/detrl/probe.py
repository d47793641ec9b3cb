"""Probe the engine for batch-composition nondeterminism, like SGLang's test_deterministic.

    python -m detrl.probe model=qwen3_moe determinism=off trials=50

The same target prompts go through the engine `trials` times under varying batch composition; per
mode it prints how many distinct outputs (token sequences, and logprob bit patterns) each target got.
Modes: `single` (the target alone or with copies of itself, batch sizes 1..N), `mixed` (with random
other prompts at random places), `prefix` (with prompts sharing the target's prefix). With
determinism on every count is 1. With off the shared sampling stream (`sampling=stream`) and the
default kernels alone (`sampling=seeded`: per-request seeds, default kernels) are shown apart.
"""

from __future__ import annotations

import dataclasses
import random
import sys

import hydra
from omegaconf import DictConfig

from detrl.config import ConfigError, TrainConfig, register_configs, to_typed
from detrl.rollout import EmbeddedEngine, Request

MODES = ("single", "mixed", "prefix")


def _batches(mode: str, target: Request, pool: list[tuple[int, ...]], trials: int, max_bs: int, rng: random.Random):
    """`trials` batches for one mode, each containing `target` once; yields (batch, index of target)."""
    for t in range(trials):
        size = 1 + t % max_bs
        if mode == "single":
            others = [target.prompt_ids] * (size - 1)
        elif mode == "mixed":
            others = [rng.choice(pool) for _ in range(size - 1)]
        else:  # prefix: the target's prompt cut short and completed with other digits
            cut = rng.randint(1, len(target.prompt_ids) - 1)
            others = [target.prompt_ids[:cut] + rng.choice(pool)[cut:] or target.prompt_ids for _ in range(size - 1)]
        batch = [dataclasses.replace(target, prompt_uid=target.prompt_uid + 1 + i, prompt_ids=ids)
                 for i, ids in enumerate(others)]
        pos = rng.randint(0, len(batch))
        batch.insert(pos, target)
        yield batch, pos


def probe(cfg: TrainConfig, trials: int, targets: int = 3, max_bs: int = 24, seeded: bool | None = None):
    """-> {mode: (max distinct token outputs, max distinct logprob patterns)} over the targets."""
    from detrl.determinism import stable_hash
    from detrl.trainer import build
    from detrl.warmstart import encode

    det, tokenizer, task, ctx_len, model, params = build(cfg)
    engine = EmbeddedEngine(model, det.ops, ctx_len, params, seed=cfg.seed, num_workers=1,
                            max_batch_size=max_bs, fixed_routing=det.fixed_routing)
    pool = [tuple(encode(tokenizer, task[i].prompt)) for i in range(len(task))]
    use_seed = det.enabled if seeded is None else seeded
    rng = random.Random(cfg.seed)
    counts = {}
    for mode in MODES:
        worst = (0, 0)
        for j in range(targets):
            uid = det.prompt_uid(j)
            target = Request(uid * 1000, 0, pool[j], stable_hash("probe", cfg.seed, j) if use_seed else None)
            outs = []
            for batch, pos in _batches(mode, target, pool, trials, max_bs, rng):
                res = engine.run_batch(batch)[pos]
                outs.append((tuple(res.tokens), tuple(res.logprobs)))
            worst = max(worst[0], len({o[0] for o in outs})), max(worst[1], len(set(outs)))
        counts[mode] = worst
    return counts


def format_table(rows: dict[str, dict[str, tuple[int, int]]], trials: int) -> str:
    lines = [f"| setting | {' | '.join(MODES)} |", "|---|" + "---|" * len(MODES)]
    for name, counts in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{counts[m][0]} tokens / {counts[m][1]} logprobs" for m in MODES) + " |")
    return f"distinct outputs per target over {trials} trials (worst of 3 targets; 1 = deterministic)\n" + "\n".join(lines)


register_configs()


@hydra.main(version_base="1.3", config_path="../../conf", config_name="probe")
def main(cfg: DictConfig) -> None:
    try:
        typed = to_typed(cfg)
    except (ConfigError, ValueError) as e:
        print(f"detrl.probe: config error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    trials = typed.trials
    name = f"{typed.model.name} determinism={typed.determinism.name}"
    rows = {f"{name} sampling={'seeded' if typed.determinism.enabled else 'stream'}": probe(typed, trials)}
    if not typed.determinism.enabled:
        rows[f"{name} sampling=seeded"] = probe(typed, trials, seeded=True)
    print(format_table(rows, trials))


if __name__ == "__main__":
    main()
