"""Divergence forensics: where two runs part ways, and which module first computes different bits.

    python -m detrl.forensics RUN_A RUN_B [--step N] [--canary 4x16@0]

1. From both runs' `metrics.jsonl`: the last step where `fp/params` agree and the first where they
   don't (and the first step where any `fp/*` fingerprint differs, with the keys: a rollout usually
   parts before the parameters do).
2. Both runs' exact-resume checkpoints at the first differing step, or the nearest step after it
   that both have (`--step N` picks one). Each policy is rebuilt from its run's `config.yaml`
   (`build_model(ModelConfig(**cfg["model"]), seed)` + `load_state_dict`).
3. The parameters themselves: the first differing tensor in module order.
4. A canary batch -- seeded random token ids within the vocab, fixed shape, independent of the runs --
   through transformers' own forward of both models (not detrl's functional forward), with a forward
   hook on every submodule; the hooks fire as modules finish, so a child always comes before its
   parent and the first differing output names the innermost module that computed different bits.
   Printed: that module (qualified name, op type) with max abs and relative L2 diff, then every
   module's diff in execution order.

Both models run in this process on the same input with the same shapes, so any difference comes from
the weights, not from the kernels. `layer_digests` is the per-step version of step 4 for the trainer:
a digest of each decoder layer's output on the canary (`fp/layers/<i>`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from detrl.fingerprint import digest

DEFAULT_CANARY = "4x16@0"


# ----------------------------------------------------------------------------------------- canary
def parse_canary(spec: str) -> tuple[int, int, int]:
    """'BxT@SEED' (or 'BxT', seed 0) -> (B, T, seed)."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?", spec.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--canary={spec!r} is not valid; use BATCHxLENGTH[@SEED], e.g. {DEFAULT_CANARY}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def make_canary(vocab_size: int, spec: str = DEFAULT_CANARY) -> torch.Tensor:
    """Seeded random token ids [B, T] in [0, vocab_size): the same batch for any run, any process."""
    b, t, seed = parse_canary(spec)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (b, t), generator=g, dtype=torch.long)


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in a module's output (tuples, lists, dicts / ModelOutput; caches and None skipped)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


def _decoder_layers(model) -> list[torch.nn.Module]:
    inner = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(inner.layers)


@torch.no_grad()
def _run(
    model, canary: torch.Tensor, modules: list[tuple[str, torch.nn.Module]]
) -> list[tuple[str, str, list]]:
    """Forward the canary with hooks on `modules`; -> [(name, op type, output tensors)] in the order the
    modules finished (a module called twice appears twice, the second as `name#1`)."""
    calls: list[tuple[str, str, list]] = []
    seen: dict[str, int] = {}

    def hook(name):
        def fn(mod, args, out):
            k = seen.get(name, 0)
            seen[name] = k + 1
            calls.append(
                (
                    name if k == 0 else f"{name}#{k}",
                    type(mod).__name__,
                    [t.detach().clone() for t in _tensors(out)],
                )
            )

        return fn

    handles = [mod.register_forward_hook(hook(name)) for name, mod in modules]
    was_training = model.training
    model.eval()
    try:
        model(input_ids=canary, use_cache=False)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return calls


def layer_digests(model, canary: torch.Tensor) -> dict[str, str]:
    """{'0': digest, '1': ...}: each decoder layer's output hidden states on the canary batch, as 16 hex
    of their exact bytes (`detrl.fingerprint.digest`). Log as `fp/layers/<i>` every k steps: where two
    runs' `fp/params` part, the first layer whose digest differs says where in the network they part. Runs transformers' forward in eval mode under no_grad
    (restores the mode; draws no random numbers). Same canary, same process settings -> same bits for
    the same weights (CPU gemms are run-to-run deterministic for a fixed shape and thread count)."""
    layers = [(str(i), layer) for i, layer in enumerate(_decoder_layers(model))]
    out = {}
    for name, _, ts in _run(model, canary, layers):
        hidden = ts[0].contiguous()
        out[name] = digest([hidden.view(torch.uint8).numpy().tobytes()])
    return out


# ------------------------------------------------------------------------------------ comparisons
@dataclass
class Diff:
    name: str
    op: str  # the module's class (for a parameter: its dtype and shape)
    max_abs: float
    rel_l2: float  # ||a - b|| / ||a||, over the floating-point outputs
    equal: bool  # bitwise, every output
    ids_changed: float | None = None  # integer outputs (an MoE router's expert ids): fraction that differ


def _diff(name: str, op: str, a: list[torch.Tensor], b: list[torch.Tensor]) -> Diff:
    if len(a) != len(b) or any(x.shape != y.shape or x.dtype != y.dtype for x, y in zip(a, b, strict=False)):
        return Diff(name, op, float("inf"), float("inf"), False)
    ints = [(x, y) for x, y in zip(a, b, strict=True) if not (x.is_floating_point() or x.is_complex())]
    n_ids = sum(x.numel() for x, _ in ints)
    ids = sum((x != y).sum().item() for x, y in ints) / n_ids if n_ids else None
    equal = all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if equal:
        return Diff(name, op, 0.0, 0.0, True, ids)
    max_abs, num, den = 0.0, 0.0, 0.0
    for x, y in zip(a, b, strict=True):
        if not (x.is_floating_point() or x.is_complex()):
            continue
        x, y = x.double(), y.double()
        d = x - y
        if d.numel():
            max_abs = max(max_abs, d.abs().max().item())
        num += d.square().sum().item()
        den += x.square().sum().item()
    rel = (num**0.5) / (den**0.5) if den > 0 else (0.0 if num == 0 else float("inf"))
    return Diff(name, op, max_abs, rel, False, ids)


def compare_params(sd_a: dict, sd_b: dict) -> list[Diff]:
    """Every tensor of the two state dicts, in A's order (module order: the order modules register)."""
    out = []
    for name, a in sd_a.items():
        b = sd_b.get(name)
        op = f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
        out.append(
            Diff(name, op, float("inf"), float("inf"), False) if b is None else _diff(name, op, [a], [b])
        )
    return out


def compare_forward(model_a, model_b, canary: torch.Tensor) -> list[Diff]:
    """The canary through both models with hooks on every module; -> one Diff per module call, in
    execution (finish) order. The root model is named '(model)'."""

    def named(m):
        return [(name or "(model)", mod) for name, mod in m.named_modules()]

    ca, cb = _run(model_a, canary, named(model_a)), _run(model_b, canary, named(model_b))
    if [c[0] for c in ca] != [c[0] for c in cb]:
        raise RuntimeError("the two models did not run the same modules in the same order")
    return [_diff(na, op, ta, tb) for (na, op, ta), (_, _, tb) in zip(ca, cb, strict=True)]


# ------------------------------------------------------------------------------------------ runs
def read_metrics(run_dir: Path) -> dict[int, dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run dir?)")
    rows = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row
    return rows


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(
        int(p.parent.name.split("-")[1]) for p in (Path(run_dir) / "checkpoints").glob("step-*/state.pt")
    )


def run_config(run_dir: Path, payload: dict | None = None) -> dict:
    path = Path(run_dir) / "config.yaml"
    if path.is_file():
        from omegaconf import OmegaConf

        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if payload is not None:
        return payload["config"]
    raise FileNotFoundError(f"{run_dir}: no config.yaml")


def load_policy(run_dir: Path, step: int) -> tuple[torch.nn.Module, dict]:
    """The run's policy at checkpoint `step`, built from its config.yaml; -> (model, state_dict)."""
    from detrl.config import ModelConfig
    from detrl.models.build import build_model

    payload = torch.load(Path(run_dir) / "checkpoints" / f"step-{step:06d}" / "state.pt", weights_only=True)
    cfg = run_config(run_dir, payload)
    model = build_model(ModelConfig(**cfg["model"]), seed=cfg.get("seed", 0))
    model.load_state_dict(payload["model"])
    return model.eval(), payload["model"]


@dataclass
class Report:
    run_a: str
    run_b: str
    common_steps: list[int] = field(default_factory=list)
    last_agree: int | None = None  # last step with equal fp/params (None: they differ from the first)
    first_differ: int | None = None  # first step with different fp/params (None: no divergence)
    first_fp: tuple[int, list[str]] | None = None  # first step where any fp/* differs, and which keys
    checkpoints_a: list[int] = field(default_factory=list)
    checkpoints_b: list[int] = field(default_factory=list)
    requested_step: int | None = None  # --step
    step: int | None = None  # the checkpoint step compared (None: not compared)
    step_note: str = ""
    canary: str = DEFAULT_CANARY
    params: list[Diff] = field(default_factory=list)
    modules: list[Diff] = field(default_factory=list)

    @property
    def diverged(self) -> bool:
        return self.first_differ is not None

    @property
    def first_param(self) -> Diff | None:
        return next((d for d in self.params if not d.equal), None)

    @property
    def first_module(self) -> Diff | None:
        return next((d for d in self.modules if not d.equal), None)

    def format(self) -> str:
        n = len(self.common_steps)
        span = f"{self.common_steps[0]}..{self.common_steps[-1]}" if n else "-"
        if not self.diverged and self.step is None and self.requested_step is None:
            fp = (
                f"; but fp/{{{', '.join(self.first_fp[1])}}} differ at step {self.first_fp[0]}"
                if self.first_fp
                else ""
            )
            return f"no divergence: fp/params equal at all {n} common steps ({span}){fp}"
        lines = []
        if self.diverged:
            agree = f"last equal step {self.last_agree}" if self.last_agree is not None else "no equal step"
            lines.append(
                f"fp/params: {agree}, first differing step {self.first_differ} (of common steps {span})"
            )
        else:
            lines.append(
                f"fp/params equal at all {n} common steps ({span}); comparing step {self.requested_step} as asked (--step)"
            )
        if self.first_fp:
            lines.append(
                f"first differing fingerprint: step {self.first_fp[0]}: {', '.join(self.first_fp[1])}"
            )
        if self.step is None:
            lines.append(self.step_note)
            return "\n".join(lines)
        lines.append(f"checkpoints compared: step {self.step} ({self.step_note})")
        fp_ = self.first_param
        ndiff = sum(not d.equal for d in self.params)
        if fp_ is None:
            lines.append(f"parameters: all {len(self.params)} tensors bitwise equal")
        else:
            lines.append(
                f"parameters: {ndiff} of {len(self.params)} tensors differ; first in module order: "
                f"{fp_.name} ({fp_.op}) max_abs={fp_.max_abs:.3e} rel_l2={fp_.rel_l2:.3e}"
            )
        fm = self.first_module
        if fm is None:
            lines.append(f"canary {self.canary}: every module's output is bitwise equal")
        else:
            lines.append(
                f"canary {self.canary}: first module whose output differs: {fm.name} ({fm.op}) "
                f"max_abs={fm.max_abs:.3e} rel_l2={fm.rel_l2:.3e}"
            )
        if self.modules:
            w = max(len(d.name) for d in self.modules)
            wo = max(len(d.op) for d in self.modules)
            lines.append(f"  {'module (execution order)':<{w}}  {'op':<{wo}}  {'max_abs':>9}  {'rel_l2':>9}")
            for d in self.modules:
                mark = "<- first" if d is fm else ""
                if d.ids_changed:
                    mark = f"ids changed: {d.ids_changed:.1%}  {mark}"
                diff = f"{d.max_abs:9.2e}  {d.rel_l2:9.2e}" if not d.equal else f"{'0':>9}  {'0':>9}"
                lines.append(f"  {d.name:<{w}}  {d.op:<{wo}}  {diff}  {mark}".rstrip())
        return "\n".join(lines)

    __str__ = format


def _to(run, step: int) -> str:
    return f"{Path(run)}_to{step}"


def _rerun(run, step: int) -> str:
    """The command that reruns `run` (its Hydra overrides, when it has them) to `step` into a new run dir."""
    over = Path(run) / ".hydra" / "overrides.yaml"
    drop = ("steps=", "run_dir=", "resume=", "checkpoint.")
    args = (
        [o for o in (yaml.safe_load(over.read_text()) or []) if not o.startswith(drop)]
        if over.is_file()
        else []
    )
    args = args or ["<its overrides>"]
    return " ".join(["python train.py", *args, f"steps={step}", f"run_dir={_to(run, step)}"])


def _first_fp(rows_a, rows_b, steps) -> tuple[int, list[str]] | None:
    for s in steps:
        keys = sorted(k for k in rows_a[s] if k.startswith("fp/") and rows_a[s][k] != rows_b[s].get(k))
        if keys:
            return s, keys
    return None


def first_divergence(run_a, run_b, step: int | None = None, canary: str = DEFAULT_CANARY) -> Report:
    """Where runs A and B first differ: the step (from fp/params), then at the first checkpoint at or
    after it that both have (or at `step`), the first differing parameter and the first module whose
    output on the canary batch differs. No divergence and no `step`: nothing is loaded."""
    parse_canary(canary)
    rows_a, rows_b = read_metrics(run_a), read_metrics(run_b)
    steps = sorted(set(rows_a) & set(rows_b))
    r = Report(
        str(run_a),
        str(run_b),
        steps,
        canary=canary,
        requested_step=step,
        checkpoints_a=checkpoint_steps(run_a),
        checkpoints_b=checkpoint_steps(run_b),
    )
    r.first_fp = _first_fp(rows_a, rows_b, steps)
    for s in steps:
        if rows_a[s].get("fp/params") == rows_b[s].get("fp/params"):
            r.last_agree = s
        else:
            r.first_differ = s
            break
    both = sorted(set(r.checkpoints_a) & set(r.checkpoints_b))
    if step is not None:
        if step not in both:
            r.step_note = (
                f"no checkpoint at step {step} in both runs (A has {r.checkpoints_a or 'none'}, "
                f"B has {r.checkpoints_b or 'none'})"
            )
            return r
        r.step, r.step_note = step, "--step"
    elif r.diverged:
        after = [s for s in both if s >= r.first_differ]
        if not after:
            n = r.first_differ
            r.step_note = (
                f"no checkpoint at or after step {n} in both runs (A has {r.checkpoints_a or 'none'}, B has "
                f"{r.checkpoints_b or 'none'}; checkpoint.keep_last=2 keeps the last two). A run checkpoints "
                f"its last step: rerun each to step {n}, `{_rerun(run_a, n)}` and `{_rerun(run_b, n)}`, then "
                f"`python -m detrl.forensics {_to(run_a, n)} {_to(run_b, n)}` (or keep every checkpoint: "
                "checkpoint.every=1 checkpoint.keep_last=<steps>)"
            )
            return r
        r.step = after[0]
        r.step_note = (
            "the first differing step"
            if r.step == r.first_differ
            else f"the nearest checkpoint after the first differing step {r.first_differ}"
        )
    else:
        return r
    model_a, sd_a = load_policy(run_a, r.step)
    model_b, sd_b = load_policy(run_b, r.step)
    r.params = compare_params(sd_a, sd_b)
    r.modules = compare_forward(model_a, model_b, make_canary(model_a.config.vocab_size, canary))
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m detrl.forensics", description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    p.add_argument("--step", type=int, default=None, help="compare the checkpoints at this step")
    p.add_argument("--canary", default=DEFAULT_CANARY, help=f"BATCHxLENGTH[@SEED] (default {DEFAULT_CANARY})")
    a = p.parse_args(argv)
    try:
        print(first_divergence(a.run_a, a.run_b, a.step, a.canary).format())
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
