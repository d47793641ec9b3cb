"""torchrun (gloo, CPU): FSDP2 gradients equal one process's; determinism=on runs are bitwise run to run, the same
bits on 1, 2 and 3 ranks (the tiny config and the defaults, dense and MoE), and resume exactly from a 2-rank
(DCP) checkpoint.

Four torchrun launches (imports dominate: ~10 s per launch on 2 cores): `train.py` itself; this file as a worker
(`python -m torch.distributed.run ... tests/test_distributed.py worker DIR`) that in one process group checks
gradients, repeats the first run, resumes it from its step-1 checkpoint, trains the MoE, and runs `off`; and
this file's `defaults` worker on 2 and 3 ranks (the "on" gradient cases, then the default config).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FP = ("fp/params", "fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order")
# (model, determinism, loss_agg_mode) of the gradient check; token-sum-norm has no sequence count in
# its denominator, so it is the one that needs dp_size to survive averaging
GRAD_CASES = [
    ("qwen3", "on", "token-mean"),
    ("qwen3", "off", "token-sum-norm"),
    ("qwen3_moe", "on", "seq-mean-token-mean"),
    ("qwen3_moe", "off", "token-mean"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str, nproc: int = 2) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-5000:]


def _train_args(run_dir: Path, *extra: str) -> list[str]:
    from tests.conftest import TINY

    # micro_batch_size=8: 4 micro-batches per mini-batch (32 sequences), so both ranks train
    tiny = [o for o in TINY if not o.startswith("steps=")]
    return [*tiny, "steps=2", "rollout.num_workers=1", "micro_batch_size=8", f"run_dir={run_dir}", *extra]


def _fps(run_dir: Path) -> list[list[str]]:
    from tests.conftest import read_metrics

    return [[r["step"], *(r[k] for k in FP)] for r in read_metrics(run_dir)]


def _one_process(run_dir: Path, *extra: str) -> None:
    from detrl.trainer import train
    from tests.conftest import make_cfg

    train(make_cfg(*[o for o in _train_args(run_dir, *extra) if not o.startswith("run_dir=")]), run_dir)


def _grads(model_name: str, det: str, mode: str, dp=None) -> list[torch.Tensor]:
    """update() on test_update's batch (2 groups of 4, micro_batch_size 2: 4 micro-batches) -> the gradient."""
    from detrl.config import ModelConfig
    from detrl.models import build_model
    from detrl.models.forward import rope_tables
    from tests.actor_helpers import update
    from tests.test_update import OPS, L, _batch, _cfg, _Recorder

    class Full(_Recorder):  # records the whole gradient (gathered from the FSDP2 shards)
        def step(self):
            self.grads.append([getattr(p.grad, "full_tensor", p.grad.clone)() for p in self.params])

    model = build_model(ModelConfig(name=model_name), seed=0)
    ref = build_model(ModelConfig(name=model_name), seed=1).requires_grad_(False)
    if dp is not None:
        from detrl import distributed

        distributed.shard(model, ref)
        dp = distributed.DataParallel(model, ordered=det == "on")
    cfg = _cfg("micro_batch_size=2", f"algo.loss_agg_mode={mode}", "algo.kl_loss_coef=0.1")
    batch, adv = _batch()
    opt = Full(model.parameters())
    update(model, ref, opt, batch, adv, cfg, OPS[det], L, rope_tables(model.config, L), version=0, dp=dp)
    return opt.grads[0]


DEFAULTS = ["logger=none", "checkpoint.save_final=false", "device=cpu"]
# dense: 2 steps (the second rollout runs on the weights the ranks' first update synced to the engine); MoE: 1 step
# (the same sync code; its first update already differed at the defaults before the fix)
DEFAULT_STEPS = {"dense": 2, "moe": 1}
DEFAULT_RUNS = [(m, [f"steps={n}"] + ["model=qwen3_moe"] * (m == "moe")) for m, n in DEFAULT_STEPS.items()]


def _defaults_worker(out: Path) -> None:
    """Under torchrun: the "on" gradient cases, then the default config (dense, then MoE) in one process group."""
    from detrl import distributed
    from detrl.trainer import train
    from tests.conftest import make_cfg

    distributed.init()
    torch.use_deterministic_algorithms(True)  # the gradient cases' (train sets its own)
    got = {case: _grads(*case, dp=True) for case in GRAD_CASES if case[1] == "on"}
    if distributed.is_main():
        out.mkdir(parents=True, exist_ok=True)
        torch.save(got, out / "grads.pt")
    for name, extra in DEFAULT_RUNS:
        train(make_cfg(*DEFAULTS, *extra), out / name)
    distributed.close()


def _worker(out: Path) -> None:
    """Under torchrun: the gradient cases, then three training runs in one process group."""
    from detrl import distributed
    from detrl.trainer import train
    from tests.conftest import make_cfg

    distributed.init()
    torch.use_deterministic_algorithms(True)
    got = {case: _grads(*case, dp=True) for case in GRAD_CASES}
    if distributed.is_main():
        torch.save(got, out / "grads.pt")
        # the resume run starts from a copy of run A holding only A's step-1 checkpoint
        shutil.copytree(out / "a", out / "resumed")
        shutil.rmtree(out / "resumed" / "checkpoints" / "step-000002")
        (out / "resumed" / "summary.json").unlink()
    distributed.barrier()

    def run(name: str, *extra: str) -> None:
        args = [o for o in _train_args(out / name, *extra) if not o.startswith("run_dir=")]
        train(make_cfg(*args), out / name)

    run("b", "checkpoint.every=1")
    run("resumed", "checkpoint.every=1", "resume=auto")
    run("moe", "model=qwen3_moe")
    run("off", "determinism=off")  # groups claimed from the store's shared counter, gradients averaged
    run("reduce", "determinism.reduce=all_reduce")  # on, but the gradients averaged by the all-reduce
    distributed.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _torchrun("train.py", *_train_args(out / "a", "checkpoint.every=1"))
    _torchrun(__file__, "worker", str(out))
    _one_process(out / "one", "checkpoint.every=1")
    _one_process(out / "one-moe", "model=qwen3_moe")
    return out


def test_fsdp2_gradients_equal_one_process(runs):
    """The functional forward under explicit unshard sends gradients to the sharded parameters: on, bitwise
    (micro-batch gradients summed in one process's order); off (contiguous shares, loss x dp_size, averaged
    all-reduce), to float tolerance; the denominators are global."""
    got = torch.load(runs / "grads.pt")
    torch.use_deterministic_algorithms(True)
    try:
        for case, grads in got.items():
            want = _grads(*case)
            assert any(w.abs().sum() > 0 for w in want)
            for g, w in zip(grads, want, strict=True):
                if case[1] == "on":
                    assert torch.equal(g, w), case
                else:  # another summation order (per-rank accumulation, then the all-reduce): rounding only
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))
    finally:
        torch.use_deterministic_algorithms(False)


def test_two_ranks_run_to_run_bitwise(runs):
    assert len(_fps(runs / "a")) == 2
    assert _fps(runs / "a") == _fps(runs / "b")  # every step, every fingerprint
    assert (runs / "a" / "checkpoints" / "step-000001" / "dcp").is_dir()


def test_one_and_two_ranks_give_the_same_bits(runs):
    """Same config, same micro_batch_size (4 micro-batches of 8 per mini-batch, 2 per rank): see
    detrl.distributed.DataParallel for why nothing depends on the number of ranks."""
    assert _fps(runs / "a") == _fps(runs / "one")
    assert _fps(runs / "moe") == _fps(runs / "one-moe")


def test_two_rank_checkpoint_resumes_exactly(runs):
    assert _fps(runs / "resumed") == _fps(runs / "a")


def test_off_trains_on_two_ranks(runs):
    from tests.conftest import read_metrics

    rows = read_metrics(runs / "off")
    assert [r["step"] for r in rows] == [1, 2] and all(r["response_length/mean"] > 0 for r in rows)
    assert rows[-1]["fp/params"] != _fps(runs / "a")[-1][1]  # it trained (its own trajectory)


def test_released_reduce_alone_changes_only_the_parameters(runs):
    """determinism=on with reduce=all_reduce: the rollouts stay the ordered run's until the parameters part (each
    rank sums its contiguous share, the all-reduce adds the two: another summation order than micro-batch order;
    measured here: step 1 equal, other parameters at step 2)."""
    from detrl.analysis import first_divergence
    from tests.conftest import read_metrics

    d = first_divergence(read_metrics(runs / "reduce"), read_metrics(runs / "a"))
    assert d is not None and d[1] == "fp/params", d


@pytest.fixture(scope="module")
def defaults(tmp_path_factory) -> Path:
    """The default config (dense 2 steps, MoE 1 step) on 1, 2 and 3 ranks."""
    from detrl.trainer import train
    from tests.conftest import make_cfg

    out = tmp_path_factory.mktemp("defaults")
    for w in (2, 3):
        _torchrun(__file__, "defaults", str(out / f"w{w}"), nproc=w)
    for name, extra in DEFAULT_RUNS:
        train(make_cfg(*DEFAULTS, *extra), out / "w1" / name)
    return out


def test_ranks_hold_zero_one_and_several_micro_batches():
    """The layouts the default runs below exercise (32 prompts x 8 = 256 sequences, mini-batches of 128,
    micro-batches of 64): 3 ranks -> ranks holding 1, 1, 0 micro-batches of a mini-batch, and 2, 1, 1 of the
    old-logprob pass; the tiny runs above (micro_batch_size=8, mini-batches of 16): 2 per rank."""
    from detrl.distributed import micro_batches

    def held(n, mb, w):
        return [len(micro_batches(0, n, mb, w, r, ordered=True)) for r in range(w)]

    assert held(128, 64, 3) == [1, 1, 0] and held(256, 64, 3) == [2, 1, 1]
    assert held(128, 64, 2) == [1, 1] and held(16, 8, 2) == [1, 1] and held(32, 8, 2) == [2, 2]


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_defaults_give_the_same_bits_on_one_two_and_three_ranks(defaults, model):
    """`python train.py` vs `torchrun --nproc-per-node 2|3 train.py` at the defaults (micro_batch_size=64: one
    micro-batch per rank, or none): every fingerprint at every step, and each rank at a plain process's thread
    count (torchrun's OMP_NUM_THREADS=1 would put them on other kernels on a many-core machine)."""
    import json

    one = _fps(defaults / "w1" / model)
    assert len(one) == DEFAULT_STEPS[model]
    for w in (2, 3):
        assert _fps(defaults / f"w{w}" / model) == one, w
        threads = json.loads((defaults / f"w{w}" / model / "numerics.json").read_text())["threads"]
        assert threads == json.loads((defaults / "w1" / model / "numerics.json").read_text())["threads"]


def test_three_rank_gradients_equal_one_process(defaults):
    """3 ranks, 4 micro-batches: rank 0 holds two, ranks 1 and 2 one each, and the second round has one sender
    only; the shards exchanged round by round add up to one process's gradient, bit for bit."""
    got = torch.load(defaults / "w3" / "grads.pt")
    torch.use_deterministic_algorithms(True)
    try:
        assert len(got) == 2
        for case, grads in got.items():
            want = _grads(*case)
            for g, w in zip(grads, want, strict=True):
                assert torch.equal(g, w), case
    finally:
        torch.use_deterministic_algorithms(False)


def test_trainer_threads_are_a_plain_processs():
    from detrl.distributed import trainer_threads

    assert trainer_threads({}, 16, 1, True) is None  # one process: torch's own choice
    assert trainer_threads({"OMP_NUM_THREADS": "1"}, 16, 2, True) == 16  # torchrun's default
    assert trainer_threads({"OMP_NUM_THREADS": "4"}, 16, 2, True) == 4  # the user's
    assert trainer_threads({"OMP_NUM_THREADS": "1"}, 16, 2, False) is None  # off: torchrun's


def test_intra_op_threads_sets_then_restores_even_on_error():
    from detrl.distributed import intra_op_threads

    before = torch.get_num_threads()
    with intra_op_threads(None):
        assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), intra_op_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("a benchmark row failed")
    assert torch.get_num_threads() == before


if __name__ == "__main__" and sys.argv[1] == "worker":
    _worker(Path(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1] == "defaults":
    _defaults_worker(Path(sys.argv[2]))
