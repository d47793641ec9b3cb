"""python -m detrl.plan <train.py overrides> --world-size N --device-memory-gib G [--device cuda|cpu]
[--layout code|today|fsdp2] [--json PATH]: the per-rank memory table of a run and whether it fits."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from detrl.config import ConfigError
from detrl.plan import GIB, LAYOUTS, code_layout, config_layout, context_bound, for_config, verdict
from detrl.plan.memory import PHASES


def compose(overrides: list[str]):
    """The run's config, composed as train.py composes it (conf/ next to train.py), validated."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import open_dict

    from detrl.config import register_configs, to_typed

    conf = Path(__file__).resolve().parents[3] / "conf"
    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = hydra_compose("train", overrides=overrides)
    if (
        cfg.data.name != "arithmetic"
    ):  # the planner reads no data file: placeholders satisfy the files' checks
        with open_dict(cfg):
            cfg.data.path = cfg.data.path or "(not read by the planner)"
            cfg.data.eval_path = cfg.data.eval_path or cfg.data.path
    return to_typed(cfg)


def table(phases: dict[str, dict[str, float]], peak: str) -> str:
    names = [p for p in PHASES if p in phases]
    parts = list(dict.fromkeys(k for ph in names for k in phases[ph]))
    head = f"{'GiB per rank':<18}" + "".join(f"{p + ('*' if p == peak else ''):>11}" for p in names)
    rows = [head]
    for part in parts:
        rows.append(f"{part:<18}" + "".join(f"{phases[p].get(part, 0.0) / GIB:>11.2f}" for p in names))
    rows.append(f"{'total':<18}" + "".join(f"{sum(phases[p].values()) / GIB:>11.2f}" for p in names))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m detrl.plan", description=__doc__)
    ap.add_argument("overrides", nargs="*", help="train.py's overrides, e.g. experiment=qwen3_8b_gsm8k_grpo")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--device-memory-gib", type=float, required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layout", choices=("code", *LAYOUTS), default="code", help="code: the trainer as it is")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_intermixed_args(argv)
    for flag, value in (("--world-size", args.world_size), ("--device-memory-gib", args.device_memory_gib)):
        if value <= 0:
            print(f"detrl.plan: {flag}={value} is not valid: must be > 0", file=sys.stderr)
            return 2
    try:
        cfg = compose(args.overrides)
        ctx = context_bound(cfg)
    except (ConfigError, ValueError) as e:
        print(f"detrl.plan: config error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    lay = (
        config_layout(code_layout(), cfg, args.world_size) if args.layout == "code" else LAYOUTS[args.layout]
    )
    p, s, w, lay = for_config(cfg, ctx, args.world_size, args.device, args.device_memory_gib * GIB, lay)
    print(
        f"{cfg.model.name}: {s.params / 1e9:.3f}B parameters, ctx_len {ctx}, micro-batch {w.micro_batch} x "
        f"{w.micro_batches} per mini-batch, {w.device} compute {8 * w.compute_bytes}-bit, layout {vars(lay)}"
    )
    print(table(p.phases, p.peak_phase))
    line = verdict(p, s, w, lay, args.world_size)
    print(line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "fits": p.fits,
                    "per_rank_gib": p.per_rank / GIB,
                    "parts_gib": {k: v / GIB for k, v in p.parts.items()},
                    "peak_phase": p.peak_phase,
                    "phases_gib": {ph: {k: v / GIB for k, v in d.items()} for ph, d in p.phases.items()},
                    "device_memory_gib": args.device_memory_gib,
                    "world_size": args.world_size,
                    "params": s.params,
                    "ctx_len": ctx,
                    "layout": vars(lay),
                    "verdict": line,
                },
                indent=1,
            )
        )
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
