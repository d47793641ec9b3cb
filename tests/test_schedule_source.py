"""The schedule (determinism.routing) as a source end to end: whole train.py runs, the sweep's report names it.

`no_kernels` (every source pinned but the kernels; routing fixed: each worker's continuous batches a function of
the requests) repeats bitwise; `no_kernels_and_routing` releases the schedule too (dynamic dispatch: groups join a
worker's running batch when results come back, as the timing says) and its repeats part in the rollout logprobs
(torch's CPU kernels give a row other bits in another batch); `no_routing` (the schedule released with the
batch-invariant kernels) repeats bitwise again (the full 3 x 3 sweep: README "Rollout engine"; the invariant
kernels' independence of the batch: tests/test_rollout_engine.py). The report reads the leave-two-out cell against `no_kernels` and
names routing as the source."""

import subprocess
import sys

from detrl.analysis import load_sweep
from detrl.analysis.ablation import ablation_findings, ablation_table, ablation_title
from detrl.report import render
from tests.conftest import ROOT


def test_a_schedule_sweep_attributes_the_divergence_to_routing(tmp_path):
    out = tmp_path / "schedule"
    cmd = [sys.executable, "train.py", "-m", "experiment=schedule_source", "steps=1", "warmstart.steps=40"]
    cmd += ["ablation=no_kernels,no_kernels_and_routing", "repeat=0,1", "checkpoint.save_final=false"]
    cmd += [f"hydra.sweep.dir={out}"]  # the smallest sweep that shows it: 2 cells x 2 repeats of 1 step
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = ablation_table(load_sweep(out)).set_index("ablation")
    assert sorted(t.index) == ["no_kernels", "no_kernels_and_routing"] and (t.repeats == 2).all()
    assert t.loc["no_kernels", "reproducible"]  # its repeats bitwise identical
    b = t.loc["no_kernels_and_routing"]
    assert (b.kind, b.source, b.reference) == ("leave-two-out", "routing", "no_kernels")
    assert b.reproducible is not None and not b.reproducible  # 2 complete repeats, not identical
    assert (b.first_divergence_step, b.first_divergence_stage) == (1, "logprobs")
    said = "routing makes repeats diverge (step 1, logprobs): routing is the source"
    assert said in " ".join(ablation_findings(t.reset_index()))
    assert "on top of no_kernels, routing breaks bitwise repeats" in ablation_title(t.reset_index())
    assert said in (render(out, tmp_path / "report") / "summary.md").read_text()


def _row(ablation, kind, source, reference, reproducible, step=None, stage=None):
    return dict(setting="all", ablation=ablation, kind=kind, source=source, reference=reference,
                reproducible=reproducible, first_divergence_step=step, first_divergence_stage=stage,
                differs_from_all_on=None, reward_spread=0.0, reward_spread_lo=0.0, reward_spread_hi=0.0,
                param_distance_last=0.0)  # fmt: skip


def test_a_leave_two_out_cell_names_its_second_source_only_against_a_reproducible_reference():
    import pandas as pd

    from detrl.analysis.ablation import kind_of, reference_of

    assert kind_of("no_kernels_and_routing") == ("leave-two-out", "routing")
    assert reference_of("no_kernels_and_routing") == "no_kernels" and reference_of("no_kernels") == "all_on"
    pair = _row("no_kernels_and_routing", "leave-two-out", "routing", "no_kernels", False, 2, "tokens")
    base = _row("no_kernels", "leave-one-out", "kernels", "all_on", True)
    named = " ".join(ablation_findings(pd.DataFrame([base, pair])))
    assert "routing makes repeats diverge (step 2, tokens): routing is the source" in named
    broken = " ".join(ablation_findings(pd.DataFrame([{**base, "reproducible": False, "first_divergence_step": 1,
                                                       "first_divergence_stage": "params"}, pair])))  # fmt: skip
    assert "is the source" not in broken and "no_kernels alone already diverges" in broken
    alone = " ".join(ablation_findings(pd.DataFrame([pair])))
    assert "is the source" not in alone and "no_kernels has no 2 complete repeats" in alone
    same = ablation_findings(pd.DataFrame([base, {**pair, "reproducible": True}]))
    assert "on top of no_kernels, routing keeps repeats bitwise identical" in " ".join(same)
