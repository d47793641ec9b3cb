"""detrl's GRPO step vs TRL's GRPOTrainer on the same work, side by side in one process.

    pip install -e '.[bench]' && python benchmarks/vs_trl.py [--steps 12] [--rounds 2]

Same model (tiny dense Qwen3 from conf/model/qwen3.yaml, same seed-0 init), same prompts (8 arithmetic
prompts per step), 4 samples each, up to 16 new tokens, GRPO without a reference model, one optimizer
step per rollout batch, the clip ratio's old logprobs taken from the gradient pass on both sides (TRL at
num_iterations=1; detrl's algo.old_logprobs=current), CPU, and the same numerics: fp32 weights and compute,
no autocast, no activation recomputation. TRL's GRPOConfig defaults are GPU defaults (bf16=True autocast,
gradient_checkpointing=True): the matched row turns both off; a second TRL row keeps its defaults, for
reference only (other work).
Runs alternate (detrl off, detrl on, TRL matched, TRL defaults) for `--rounds` rounds; the first 2 steps
of every run are warm-up; the table shows the median step time over the rest, and ratios against the
matched TRL row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import detrl  # noqa: F401 - before torch: it sets how idle OpenMP threads wait (detrl/__init__.py)

# isort: split
import torch
from hydra import compose, initialize_config_dir

from detrl.config import ModelConfig, register_configs, to_typed
from detrl.data import ArithmeticTask, build_tokenizer, exact_match_reward
from detrl.models.build import build_model

CONF = str(Path(__file__).resolve().parents[1] / "conf")
PROMPTS, SAMPLES, NEW_TOKENS, WARMUP = 8, 4, 16, 2


def detrl_steps(determinism: str, steps: int, out: Path) -> list[float]:
    from detrl.analysis import load_metrics
    from detrl.trainer import train

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = to_typed(
            compose(
                "train",
                overrides=[
                    f"determinism={determinism}",
                    f"steps={steps}",
                    f"train_batch_size={PROMPTS}",
                    f"rollout.n={SAMPLES}",
                    f"rollout.max_new_tokens={NEW_TOKENS}",
                    "algo.use_kl_loss=false",
                    "model.init=random",
                    "seed=0",
                    f"micro_batch_size={PROMPTS * SAMPLES}",
                    "algo.ppo_mini_batch_size=0",
                    "logger=none",
                    "checkpoint.save_final=false",
                    "algo.old_logprobs=current",  # TRL's work at num_iterations=1
                ],
            )
        )
    train(cfg, out)
    return [r["timing_s/step"] for r in load_metrics(out)][WARMUP:]


# TRL with detrl's numerics: fp32, no autocast, no recomputation (its defaults are bf16=True and
# gradient_checkpointing=True); TRL_DEFAULTS keeps those two at TRL's defaults (reference only)
TRL_MATCHED = dict(bf16=False, gradient_checkpointing=False)
TRL_DEFAULTS: dict = {}


BENCH_ARGS = dict(  # the same work as detrl's side: 8 prompts x 4 samples x 16 tokens, one step per batch
    per_device_train_batch_size=PROMPTS * SAMPLES,
    num_generations=SAMPLES,
    max_completion_length=NEW_TOKENS,
    beta=0.0,
    num_iterations=1,
    steps_per_generation=1,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    use_vllm=False,
    use_cpu=True,
    temperature=1.0,
    seed=0,
    shuffle_dataset=False,
)
QUIET_ARGS = dict(report_to="none", save_strategy="no", logging_steps=10_000, disable_tqdm=True)


def trl_args(out: Path, steps: int, numerics: dict):
    from trl import GRPOConfig

    return GRPOConfig(output_dir=str(out), max_steps=steps, **BENCH_ARGS, **QUIET_ARGS, **numerics)


def non_default_args(numerics: dict) -> dict:
    """The work and numerics arguments this benchmark gives GRPOConfig that differ from TRL's declared
    defaults (instantiating GRPOConfig() on a CPU fails: its bf16=True default needs a GPU)."""
    import dataclasses

    from trl import GRPOConfig

    def default(f):
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    defaults = {f.name: default(f) for f in dataclasses.fields(GRPOConfig) if f.init}
    given = {**BENCH_ARGS, **numerics}
    return {k: v for k, v in given.items() if defaults.get(k, object()) != v}


def trl_steps(steps: int, out: Path, numerics: dict) -> list[float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    answers = {p.prompt: p.answer for p in (task[i] for i in range(len(task)))}
    data = Dataset.from_list([{"prompt": task[i % len(task)].prompt} for i in range(PROMPTS * steps)])

    def reward(prompts, completions, **kwargs):
        return [exact_match_reward(c, answers[p]) for p, c in zip(prompts, completions)]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)

    args = trl_args(out, steps, numerics)
    model = build_model(ModelConfig(), seed=0)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Timer()],
    )
    trainer.train()
    return times[WARMUP:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--json", type=Path, help="also write the figures here (step_s, vs_trl, per_round, settings)"
    )
    args = ap.parse_args()
    register_configs()
    matched = "TRL GRPOTrainer, same numerics (bf16=False, gradient_checkpointing=False)"
    defaults = (
        "TRL GRPOTrainer, its defaults (bf16=True autocast, gradient_checkpointing=True): reference only"
    )
    times: dict[str, list[float]] = {
        "detrl, determinism=off": [],
        "detrl, determinism=on": [],
        matched: [],
        defaults: [],
    }
    per_round: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            this = {
                "detrl, determinism=off": detrl_steps("off", args.steps, Path(tmp) / f"off{r}"),
                "detrl, determinism=on": detrl_steps("on", args.steps, Path(tmp) / f"on{r}"),
                matched: trl_steps(args.steps, Path(tmp) / f"trl{r}", TRL_MATCHED),
                defaults: trl_steps(args.steps, Path(tmp) / f"trld{r}", TRL_DEFAULTS),
            }
            for k, v in this.items():
                times[k] += v
            per_round.append({k: statistics.median(v) for k, v in this.items()})
    shown = non_default_args(TRL_MATCHED)
    print(
        f"\nTRL {__import__('trl').__version__} GRPOConfig arguments that differ from its defaults (matched row): "
        + ", ".join(f"{k}={v!r}" for k, v in sorted(shown.items()))
    )
    trl = statistics.median(times[matched])
    print(
        f"\n{PROMPTS} prompts x {SAMPLES} samples x {NEW_TOKENS} new tokens, GRPO, no reference model, CPU "
        f"({torch.get_num_threads()} threads), fp32; median of {args.rounds} x {args.steps - WARMUP} steps\n"
    )
    print("| trainer | median step (s) | vs TRL (same numerics) | per round |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        rounds = ", ".join(f"{pr[name] / pr[matched]:.2f}x" for pr in per_round)
        print(f"| {name} | {med:.3f} | {med / trl:.2f}x | {rounds} |")
    if args.json:
        write_json(args.json, times, per_round, matched, shown)


JSON_KEYS = ("detrl_off", "detrl_on", "trl_matched", "trl_defaults")  # the rows of `times`, in order


def write_json(path: Path, times: dict, per_round: list[dict], matched: str, shown: dict) -> None:
    """The table's figures under short keys: median step seconds, each row / TRL matched, per round."""
    names = dict(zip(times, JSON_KEYS))
    trl = statistics.median(times[matched])
    figures = {
        "step_s": {names[k]: statistics.median(v) for k, v in times.items()},
        "vs_trl": {names[k]: statistics.median(v) / trl for k, v in times.items()},
        "per_round": [{names[k]: v / pr[matched] for k, v in pr.items()} for pr in per_round],
        "workload": {
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "max_new_tokens": NEW_TOKENS,
            "warmup_steps": WARMUP,
        },
        "trl_args_not_default": {k: repr(v) for k, v in shown.items()},
        "threads": torch.get_num_threads(),
    }
    path.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
