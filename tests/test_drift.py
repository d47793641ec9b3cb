"""Order-independent fingerprints, the first differing stage, and drift distances from the sketches."""

import copy
import json
import warnings

import numpy as np
import pytest
import torch
import yaml

from detrl.analysis import (
    distances,
    first_divergence,
    load_drift,
    load_sweep,
    load_wandb,
    pair_distance,
    pair_divergences,
    verdicts,
)
from detrl.fingerprint import (
    drift_step,
    flat_params,
    mean_logprob_by_uid,
    param_sketch,
    params_digest,
    rollout_fingerprints,
    uid_sketch,
)
from detrl.models.build import build_model
from detrl.rollout.base import Request, Result
from tests.conftest import make_cfg


@pytest.fixture(scope="module")
def model():
    return build_model(make_cfg("model.init=random").model, seed=0)  # the default tiny Qwen3, 312k parameters


def batch(order=None, bump=None):
    """4 prompt groups x 2 samples; `order`: a permutation of the results; `bump`: a uid whose logprobs move."""
    res = [
        Result(Request(uid, k, (1, 2)), [uid % 7 + k, 3], [-0.25 * (k + 1), -1.5 - (uid == bump)], "stop")
        for uid in (11, 42, 7, 30)
        for k in range(2)
    ]
    return [res[i] for i in order] if order else res


def write_run(root, name, overrides, rows, steps):
    d = root / name
    (d / ".hydra").mkdir(parents=True, exist_ok=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (d / "config.yaml").write_text(
        yaml.safe_dump({"steps": steps, "repeat": int(overrides[-1][-1]), "determinism": {"name": "off"}})
    )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text("{}")
    return d


# ---------------------------------------------------------------- fingerprints and stages


def test_a_reordered_batch_has_equal_content_fingerprints_and_a_different_order():
    a, b = rollout_fingerprints(batch()), rollout_fingerprints(batch(order=[5, 2, 7, 0, 1, 6, 3, 4]))
    assert a["fp/rollout_tokens"] == b["fp/rollout_tokens"]
    assert a["fp/rollout_logprobs"] == b["fp/rollout_logprobs"]
    assert a["fp/batch_order"] != b["fp/batch_order"]
    # other content, same order: the content fingerprint moves, the order one does not
    c = rollout_fingerprints(batch(bump=42))
    assert c["fp/rollout_logprobs"] != a["fp/rollout_logprobs"] and c["fp/batch_order"] == a["fp/batch_order"]


def test_the_analysis_names_order_as_the_first_stage_of_a_pure_reordering(tmp_path):
    def rows(order):
        fps = rollout_fingerprints(batch(order=order))
        # the trainer saw the same samples in another order: its sums, hence its params, differ too
        return [
            {"step": 1, **fps, "fp/params": "p" + str(order is None)},
            {"step": 2, **fps, "fp/params": "q"},
        ]

    a, b = rows(None), rows([1, 0, 3, 2, 5, 4, 7, 6])
    assert first_divergence(a, b) == (1, "fp/batch_order")
    write_run(tmp_path, "0_r0", ["determinism=off", "repeat=0"], a, 2)
    write_run(tmp_path, "1_r1", ["determinism=off", "repeat=1"], b, 2)
    v = verdicts(load_sweep(tmp_path)).set_index("cell").loc["determinism=off"]
    assert v.first_divergence_stage == "order" and v.first_divergence_step == 1
    assert v.stages_differing_then == "order+params"  # tokens and logprobs equal: a pure reordering
    assert v.verdict == "diverges at step 1 in order"
    pairs = pair_divergences(load_sweep(tmp_path))
    assert list(pairs.stages) == ["order+params"] and list(pairs.step) == [1]


# ---------------------------------------------------------------- sketches


def test_the_sketch_distance_is_within_10_percent_of_the_exact_l2_distance(model):
    for seed, kind in enumerate(["all", "one tensor", "relative"]):
        other = copy.deepcopy(model)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            params = list(other.parameters())
            for i, p in enumerate(params):
                if kind == "all":
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
                elif kind == "one tensor" and i == 3:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-2)
                elif kind == "relative":
                    p.mul_(1 + 1e-3 * torch.randn(p.shape, generator=g))
        exact = float(torch.linalg.vector_norm(flat_params(model) - flat_params(other)))  # float64, exact
        estimate = float(np.linalg.norm(param_sketch(model)[0] - param_sketch(other)[0]))
        assert exact > 0 and abs(estimate / exact - 1) < 0.10, (kind, exact, estimate)
    sketch, norm = param_sketch(model)
    assert sketch.shape == (256,) and norm == pytest.approx(
        float(torch.linalg.vector_norm(flat_params(model)))
    )


def test_the_logprob_sketch_is_keyed_by_uid_not_by_order():
    a = uid_sketch(mean_logprob_by_uid(batch()))
    assert np.array_equal(a, uid_sketch(mean_logprob_by_uid(batch(order=[7, 6, 5, 4, 3, 2, 1, 0]))))
    b = uid_sketch(mean_logprob_by_uid(batch(bump=42)))  # uid 42's mean moves by 0.5 / 2 tokens x 2 samples
    exact = abs(mean_logprob_by_uid(batch())[42] - mean_logprob_by_uid(batch(bump=42))[42])
    assert abs(np.linalg.norm(a - b) / exact - 1) < 0.25  # one coordinate: chi_256 / 16, within 25% always


def test_runs_that_differ_in_one_late_step_are_exactly_0_apart_before_it_and_not_after(tmp_path, model):
    late = 4
    for repeat in (0, 1):
        m = copy.deepcopy(model)
        run = tmp_path / f"{repeat}_determinism=off,repeat={repeat}"
        run.mkdir()
        rows = []
        for step in range(1, 7):
            with torch.no_grad():  # the same deterministic "update" in both runs...
                for p in m.parameters():
                    p.mul_(0.999)
                if repeat == 1 and step == late:  # ...except one nudge in one run at one late step
                    next(m.parameters()).view(-1)[5] += 1e-3
            res = batch(bump=42 if repeat == 1 and step >= late else None)
            rows.append({"step": step, **rollout_fingerprints(res), "fp/params": params_digest(m)})
            drift_step(run, step, m, res)
        write_run(tmp_path, run.name, ["determinism=off", f"repeat={repeat}"], rows, 6)
    a, b = (load_drift(tmp_path / f"{r}_determinism=off,repeat={r}") for r in (0, 1))
    for step in range(1, late):  # the sketches themselves are bitwise equal, not only the fingerprints
        assert np.array_equal(a[step]["param_sketch"], b[step]["param_sketch"])
    sweep = load_sweep(tmp_path)
    names = sorted(sweep.runs.run)
    d = pair_distance(sweep, *names)
    assert [d[s] for s in range(1, late)] == [0.0] * (late - 1)
    assert all(d[s] > 0 for s in range(late, 7))
    assert d[late] == pytest.approx(1e-3, rel=0.25)  # one coordinate nudged by 1e-3
    lp = pair_distance(sweep, *names, kind="logprob")
    assert [lp[s] for s in range(1, late)] == [0.0] * (late - 1) and all(lp[s] > 0 for s in range(late, 7))
    dist = distances(sweep).set_index(["cell", "step"])
    assert (
        dist.loc[("determinism=off", 1), "zero_pairs"] == 1 and dist.loc[("determinism=off", 5), "median"] > 0
    )


def test_a_resumed_run_keeps_the_last_record_of_a_step(tmp_path, model):
    for step in (1, 2, 3, 2, 3):  # resumed from step 1: steps 2 and 3 logged again
        drift_step(tmp_path, step, model, batch())
    assert sorted(load_drift(tmp_path)) == [1, 2, 3]


# ---------------------------------------------------------------- W&B source


class FakeFile:
    def __init__(self, path):
        self.path = path

    def download(self, root=".", replace=False, exist_ok=False, api=None):
        from pathlib import Path

        Path(root).mkdir(parents=True, exist_ok=True)
        (Path(root) / self.path.name).write_text(self.path.read_text())
        return open(Path(root) / self.path.name)


class FakeRun:
    """The attributes of wandb.apis.public.Run that load_wandb reads (same names, same shapes)."""

    def __init__(self, run_dir, i):
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
        self.id, self.name, self.config, self.state = f"id{i}", run_dir.name, cfg, "finished"
        self.tags = [o for o in overrides if not o.startswith("logger")]
        self.group, self.job_type = "g", ",".join(o for o in overrides if not o.startswith("repeat"))
        self._dir = run_dir

    def scan_history(self, keys=None, page_size=1000, min_step=0, max_step=None, use_cache=True):
        for r in (json.loads(x) for x in (self._dir / "metrics.jsonl").read_text().splitlines()):
            yield {
                "_step": r["step"],
                "_runtime": 1.0,
                "_timestamp": 0.0,
                **{k: v for k, v in r.items() if k != "step"},
            }

    def file(self, name):
        return FakeFile(self._dir / name)


class FakeApi:
    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(
        self, path=None, filters=None, order="+created_at", per_page=50, include_sweeps=False, lazy=True
    ):
        self.calls.append((path, filters))
        return [r for r in self._runs if r.group == filters["group"]]


def test_wandb_runs_load_like_the_local_files_and_a_dead_wandb_falls_back_to_them(
    tmp_path, model, monkeypatch
):
    test_runs_that_differ_in_one_late_step_are_exactly_0_apart_before_it_and_not_after(tmp_path, model)
    local = load_sweep(tmp_path)
    runs = [FakeRun(p, i) for i, p in enumerate(sorted(tmp_path.glob("*repeat=?")))]
    api = FakeApi(runs)
    remote = load_wandb("me/detrl/g", api=api, drift_dir=tmp_path / "dl")
    assert api.calls == [("me/detrl", {"group": "g"})] and remote.source == "wandb"
    cols = ["cell", "distinct_trajectories", "first_divergence_step", "first_divergence_stage"]
    lv = verdicts(local)
    lv = lv[lv.cell == "determinism=off"][cols].reset_index(drop=True)
    assert verdicts(remote)[cols].equals(lv)
    assert distances(remote).equals(
        distances(local)[distances(local).cell == "determinism=off"].reset_index(drop=True)
    )
    # no API key (scrubbed environment): wandb.Api raises, the local files are read instead, with a warning
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = load_sweep(tmp_path, wandb_path="me/detrl/g")
    assert fallback.source == "local" and any("reading the local files" in str(w.message) for w in caught)
    with pytest.raises(Exception):  # noqa: B017 - no local dir to fall back to: the W&B error surfaces
        load_sweep(None, wandb_path="me/detrl/g")


def test_the_device_sketch_is_exact_in_norm_within_10_percent_in_distance_and_the_same_bits_twice(model):
    """The on-device path (GPUs: no host copy), run here on CPU tensors: its distance estimates the exact L2
    distance as the host path's does, its norm is exact, and it is a pure function of the values."""
    from detrl.fingerprint import _device_gauss, _params, device_sketch

    gauss = _device_gauss(256, 4096, 20261201)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 1e-3)
    (a, norm), (a2, _) = device_sketch(_params(model)[1], gauss), device_sketch(_params(model)[1], gauss)
    b, _ = device_sketch(_params(other)[1], gauss)
    exact = float(torch.linalg.vector_norm(flat_params(model) - flat_params(other)))
    assert np.array_equal(a, a2) and abs(np.linalg.norm(a - b) / exact - 1) < 0.10
    assert norm == pytest.approx(float(torch.linalg.vector_norm(flat_params(model))), rel=1e-12)
    # as train() feeds it (distributed.drift): the parameters as an iterator, read once, gathered as read
    c, norm_c = device_sketch((p for p in _params(model)[1]), gauss)
    assert np.array_equal(a, c) and norm_c == norm


def test_the_device_params_words_change_with_any_one_word_and_repeat_bit_for_bit():
    """The GPU digest's per-tensor words (computed with torch ops, so checkable on CPU tensors): the same bytes
    give the same three int64, and flipping one bit of any one 32-bit word moves both sums."""
    from detrl.fingerprint import _device_words

    t = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    base = _device_words(t)
    assert torch.equal(base, _device_words(t.clone())) and base[0] == t.numel()
    for i in (0, 1, 499, 999):
        flipped = t.clone()
        flipped.view(torch.int32)[i] ^= 1 << (i % 31)
        w = _device_words(flipped)
        assert w[1] != base[1] and w[2] != base[2], i
    # chunked sums are the unchunked sums (mod 2**64): chunk boundaries do not change the words
    assert torch.equal(_device_words(t, chunk=7), base)


def test_the_host_sketch_keeps_packed_signs_and_matches_the_dense_projection_bitwise():
    from detrl.fingerprint import FOLD, SKETCH_SEED, _Projection

    sizes = [3000, FOLD * 300 + 7, 12345]  # blocks cross tensor boundaries; a padded last row
    tensors = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    n, rows = sum(sizes), -(-sum(sizes) // FOLD)
    g = torch.Generator().manual_seed(SKETCH_SEED)  # the dense matrix the packed signs stand for
    signs = (torch.randint(0, 2, (rows, FOLD), generator=g) * 2 - 1).to(torch.float64).numpy()
    gauss = (torch.randn(256, FOLD, generator=g, dtype=torch.float64) / 16.0).numpy()
    flat = np.zeros(rows * FOLD)
    flat[:n] = torch.cat(tensors).to(torch.float64).numpy()
    proj = _Projection(n, 256, FOLD, SKETCH_SEED)
    sketch, norm = proj(tensors)
    folded = np.einsum("ij,ij->j", flat.reshape(rows, FOLD), signs)
    assert np.array_equal(sketch, np.einsum("kj,j->k", gauss, folded))
    assert norm == pytest.approx(float(np.linalg.norm(flat)), rel=1e-12)
    assert sum(b.nbytes for b in proj.bits) <= rows * FOLD // 8  # 1 bit a parameter, not 8 bytes
