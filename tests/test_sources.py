"""Each source of nondeterminism flipped alone under otherwise-`on`: which fingerprint first differs from the
all-on run (or that none does, and why), and whether the flipped run is still reproducible."""

from __future__ import annotations

import pytest
import torch

from detrl.analysis import STAGE, first_divergence
from detrl.config import ConfigError
from detrl.determinism import SOURCES, flipped, preset, setup
from detrl.runtime import ops_for
from tests.conftest import make_cfg, run_tiny

FAST = ["steps=2"]


@pytest.fixture(scope="module")
def all_on(tmp_path_factory):
    """The all-on reference runs, dense and MoE."""
    root = tmp_path_factory.mktemp("all-on")
    return {m: run_tiny(root / m, *FAST, f"model={m}") for m in ("qwen3", "qwen3_moe")}


def _first(a, b):
    d = first_divergence(a, b)
    return d and (d[0], STAGE[d[1]])


def test_presets_set_every_source_and_one_override_flips_one():
    on, off = make_cfg("determinism=on").determinism, make_cfg("determinism=off").determinism
    assert {s: getattr(on, s) for s in SOURCES} == preset("on") and {
        s: getattr(off, s) for s in SOURCES
    } == preset("off")
    cfg = make_cfg("determinism=on", "determinism.kernels=default").determinism
    assert flipped(vars(cfg), "on") == ["kernels=default"]
    det = setup(cfg, 0)
    assert (
        ops_for(det).name == "default"
        and det.seeded_sampling
        and det.fixed_routing
        and not det.invariant_kernels
    )
    assert torch.are_deterministic_algorithms_enabled()
    released = setup(make_cfg("determinism=on", "determinism.torch_algorithms=default").determinism, 0)
    assert ops_for(released).name == "batch_invariant" and not torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (
            ["determinism.kernels=fast"],
            "determinism.kernels='fast' is not valid; choose one of ['batch_invariant', 'default']",
        ),
        (
            ["rollout.partial.enabled=true", "determinism.cut=async"],
            "determinism.cut='async' is not valid with determinism.routing='fixed'",
        ),
        (
            ["rollout=sglang", "determinism.sampling=stream"],
            "determinism.sampling='stream' is not valid with "
            "determinism.kernels='batch_invariant' on rollout=sglang",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(overrides, error):
    with pytest.raises(ConfigError) as e:
        make_cfg("determinism=on", *overrides)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_released_sampling_changes_the_tokens_and_stays_reproducible(all_on, tmp_path):
    """The engine's seeded streams instead of per-sample seeds: other tokens from step 1; but with fixed
    routing each worker's stream draws for the same batches every run, so repeats stay bitwise equal."""
    a = run_tiny(tmp_path / "a", *FAST, "determinism.sampling=stream")
    b = run_tiny(tmp_path / "b", *FAST, "determinism.sampling=stream")
    assert _first(a, all_on["qwen3"]) == (1, "tokens")
    assert _first(a, b) is None


def test_released_kernels_change_the_logprobs_and_break_on_policy(all_on, tmp_path):
    """Default kernels: the rollout's logprob bits depend on the batch, so they differ from all-on's and the
    trainer's recomputation differs from the rollout's (mismatch > 0); batches are fixed, so repeats are equal."""
    a = run_tiny(tmp_path / "a", *FAST, "determinism.kernels=default")
    b = run_tiny(tmp_path / "b", *FAST, "determinism.kernels=default")
    assert _first(a, all_on["qwen3"]) in ((1, "tokens"), (1, "logprobs"))
    assert all(r["mismatch/train_rollout_logprob_abs_diff"] > 0 for r in a)
    assert all(r["mismatch/train_rollout_logprob_abs_diff"] == 0 for r in all_on["qwen3"])
    assert _first(a, b) is None


@pytest.mark.parametrize(
    "source, value, model, why",
    [
        (
            "routing",
            "dynamic",
            "qwen3",
            "per-sample seeds and batch-invariant kernels make a sample's bits independent "
            "of its worker and batch-mates, and submission order undoes the completion order",
        ),
        (
            "order",
            "completion",
            "qwen3",
            "with fixed routing the engine already returns results in request order",
        ),
        (
            "moe_routing",
            "topk",
            "qwen3_moe",
            "torch.topk and the stable sort pick the same experts unless two router "
            "probabilities tie exactly, which these runs never hit",
        ),
    ],
)
def test_sources_that_alone_leave_the_bits_unchanged(all_on, tmp_path, source, value, model, why):
    rows = run_tiny(tmp_path, *FAST, f"model={model}", f"determinism.{source}={value}")
    assert _first(rows, all_on[model]) is None, why


def test_released_torch_algorithms_can_only_move_the_parameters(all_on, tmp_path):
    """torch's default algorithms are the trainer's (the CPU embedding backward accumulates in a thread-timing
    order, not the sorted one's): a rollout only sees parameters the all-on run had too, so the difference first
    shows in the parameters (measured: the same bits at step 1, other parameters at step 2; the ablation saw
    it at step 1 with larger batches). The default backward's order depends on how its threads interleave, so
    a run on a loaded machine can come out in the sorted one's order: up to 3 runs until one differs, and it
    must differ first in the parameters."""
    firsts = []
    try:
        for attempt in range(3):
            rows = run_tiny(tmp_path / str(attempt), *FAST, "determinism.torch_algorithms=default")
            firsts.append(_first(rows, all_on["qwen3"]))
            if firsts[-1] is not None:
                break
    finally:
        torch.use_deterministic_algorithms(False)
    # the default backward sums in another order, and a rollout sees it only through the parameters
    assert firsts[-1] is not None and firsts[-1][1] == "params", firsts


def test_async_cut_cuts_by_the_clock_and_the_budget_cut_is_reproducible(tmp_path):
    """Partial rollout, the other sources pinned: the token-budget cut gives the same bits twice; the async cut
    (which needs dynamic batches) stops running batches at a 1 ms budget wherever they are, so its batches
    differ from the budget cut's (24 groups in flight for 8, batches of 4)."""
    part = [
        "rollout.partial.enabled=true",
        "rollout.max_batch_size=4",
        "rollout.partial.oversample=3",
        "rollout.partial.off_cut=time",
        "rollout.partial.time_budget_s=0.001",
    ]
    a = run_tiny(tmp_path / "a", *FAST, *part)
    b = run_tiny(tmp_path / "b", *FAST, *part)
    assert _first(a, b) is None
    c = run_tiny(tmp_path / "c", *FAST, *part, "determinism.cut=async", "determinism.routing=dynamic")
    assert all(r["response/aborted_ratio"] > 0 for r in c)
    assert _first(c, a) is not None
