import pytest

from detrl.fingerprint import params_digest
from detrl.warmstart import load_or_build, warmstart_dir
from tests.conftest import TINY, make_cfg, read_metrics, run_tiny

FP_KEYS = ["fp/params", "fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order"]


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_three_step_run_logs_every_step_to_jsonl_and_wandb(tmp_path, model):
    from detrl.trainer import train

    cfg = make_cfg(*TINY, f"model={model}", "logger=wandb", "checkpoint.save_final=true")
    summary = train(cfg, tmp_path)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(set(r) == set(rows[0]) for r in rows)
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
                "timing_s/step", "mismatch/train_rollout_logprob_abs_diff", "mismatch/k3_kl", *FP_KEYS]:
        assert key in rows[0], key
    assert len({r["fp/params"] for r in rows}) == 3  # the weights move every step
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert (tmp_path / "checkpoint-final" / "model.safetensors").is_file()
    assert summary["steps"] == 3


@pytest.mark.parametrize("model, algo", [("qwen3", "grpo"), ("qwen3_moe", "grpo"), ("qwen3", "dapo"),
                                         ("qwen3_moe", "dapo")])
def test_determinism_on_gives_identical_fingerprints_and_true_on_policy(tmp_path, model, algo):
    # two runs with different engine layouts: 2 workers x batches of 64 vs 3 workers x batches of 5
    a = run_tiny(tmp_path / "a", f"model={model}", f"algo={algo}", "determinism=on", "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", f"model={model}", f"algo={algo}", "determinism=on", "rollout.num_workers=3",
                 "rollout.max_batch_size=5")
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    assert len({r["fp/params"] for r in a}) == 3  # not vacuous: the weights moved every step
    # the trainer's logprobs of the sampled tokens equal the rollout's, bitwise
    assert all(r["mismatch/train_rollout_logprob_abs_diff_max"] == 0.0 for r in a)
    assert all(r["mismatch/max_prob_diff"] == 0.0 for r in a)


def test_a_different_seed_gives_a_different_run(tmp_path):
    a = run_tiny(tmp_path / "a", "seed=0")
    b = run_tiny(tmp_path / "b", "seed=1")
    assert a[0]["fp/rollout_tokens"] != b[0]["fp/rollout_tokens"]


def test_determinism_off_has_real_train_rollout_mismatch(tmp_path):
    rows = run_tiny(tmp_path, "determinism=off", "train_batch_size=8")
    # default kernels: decode with the KV cache is not bitwise the trainer's full pass
    assert max(r["mismatch/train_rollout_logprob_abs_diff_max"] for r in rows) > 0.0


def test_dapo_dynamic_sampling_logs_rounds_and_kept_groups(tmp_path):
    rows = run_tiny(tmp_path, "algo=dapo")
    assert all(r["dapo/kept_groups"] == 8 for r in rows)
    assert all(r["dapo/gen_batches"] >= 1 for r in rows)


def test_dynamic_sampling_gives_up_with_a_clear_error(tmp_path):
    from detrl.trainer import train

    # temperature ~0: every group's samples agree, no group has signal
    cfg = make_cfg("steps=2", "train_batch_size=2", "rollout.n=3", "model.init=random", "logger=none", "algo=dapo",
                   "rollout.top_p=0.000001", "algo.filter_groups.max_num_gen_batches=2", "algo.overlong.enabled=false")
    with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
        train(cfg, tmp_path)


def test_warm_start_is_cached_and_reloads_bit_for_bit(tmp_path, monkeypatch):
    from detrl.data import ArithmeticTask, build_tokenizer

    monkeypatch.setenv("DETRL_CACHE_DIR", str(tmp_path))
    cfg = make_cfg("warmstart.steps=3")
    tok = build_tokenizer()
    task = ArithmeticTask(0, 9, ["+"], seed=0)
    built = load_or_build(cfg.model, cfg.data, cfg.warmstart, tok, task, ctx_len=16)
    path = warmstart_dir(cfg.model, cfg.data, cfg.warmstart, tok)
    assert (path / "model.safetensors").is_file()
    loaded = load_or_build(cfg.model, cfg.data, cfg.warmstart, tok, task, ctx_len=16)
    assert params_digest(built) == params_digest(loaded)
    other = make_cfg("warmstart.steps=4")
    assert warmstart_dir(other.model, other.data, other.warmstart, tok) != path


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])
def test_partial_rollout_on_is_bitwise_reproducible_and_really_carries(tmp_path, model):
    extra = [f"model={model}", "rollout.partial.enabled=true", "rollout.max_new_tokens=4", "steps=4"]
    a = run_tiny(tmp_path / "a", *extra, "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", *extra, "rollout.num_workers=3", "rollout.max_batch_size=5")
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    assert max(r["partial/carried"] for r in a) > 0
    assert max(r["partial/staleness_max"] for r in a) >= 1
    assert max(r["response/aborted_ratio"] for r in a) > 0
    assert all(r["mismatch/train_rollout_logprob_abs_diff_max"] == 0.0 for r in a)  # fresh tokens: on-policy


@pytest.mark.parametrize("mode", ["mask", "rescore"])
def test_stale_token_handling_modes_train(tmp_path, mode):
    rows = run_tiny(tmp_path, "rollout.partial.enabled=true", f"rollout.partial.stale_tokens={mode}", "steps=4")
    assert len(rows) == 4 and max(r["partial/staleness_max"] for r in rows) >= 1


@pytest.mark.parametrize("cut", ["groups", "time"])
def test_partial_rollout_off_runs_with_the_async_cut(tmp_path, cut):
    rows = run_tiny(tmp_path, "rollout.partial.enabled=true", "determinism=off", "rollout.max_batch_size=4",
                    f"rollout.partial.off_cut={cut}", "rollout.partial.time_budget_s=0.001")
    assert len(rows) == 3 and all(r["dapo/kept_groups"] == 8 for r in rows)


def test_max_staleness_restarts_old_partial_samples(tmp_path):
    rows = run_tiny(tmp_path, "rollout.partial.enabled=true", "rollout.partial.max_staleness=0",
                    "rollout.partial.oversample=3", "steps=4")
    assert max(r["partial/restarted"] for r in rows) > 0
    assert all(r["partial/staleness_max"] == 0 for r in rows)
