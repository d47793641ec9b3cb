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
    for key in [
        "critic/score/mean",
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "response_length/mean",
        "timing_s/step",
        "mismatch/train_rollout_logprob_abs_diff",
        "mismatch/k3_kl",
        *FP_KEYS,
    ]:
        assert key in rows[0], key
    assert len({r["fp/params"] for r in rows}) == 3  # the weights move every step
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert (tmp_path / "checkpoint-final" / "model.safetensors").is_file()
    assert summary["steps"] == 3


@pytest.mark.parametrize(
    "model, algo", [("qwen3", "grpo"), ("qwen3_moe", "grpo"), ("qwen3", "dapo"), ("qwen3_moe", "dapo")]
)
def test_determinism_on_gives_identical_fingerprints_and_true_on_policy(tmp_path, model, algo):
    # two runs with different engine layouts: 2 workers x batches of 64 vs 3 workers x batches of 5
    # two mini-batches (optimizer steps) per rollout batch, micro-batches of 12 sequences
    extra = [
        f"model={model}",
        f"algo={algo}",
        "determinism=on",
        "algo.ppo_mini_batch_size=4",
        "micro_batch_size=12",
    ]
    a = run_tiny(tmp_path / "a", *extra, "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", *extra, "rollout.num_workers=3", "rollout.max_batch_size=5")
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    assert len({r["fp/params"] for r in a}) == 3  # not vacuous: the weights moved every step
    assert all(r["actor/optimizer_steps"] == 2 for r in a)
    assert any(r["actor/ppo_kl"] != 0.0 for r in a)  # the second mini-batch's policy is not the old one
    # the trainer's old logprobs (its no-grad pass before the update) of the sampled tokens equal the
    # rollout's, bitwise
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


@pytest.mark.parametrize("metric", ["acc", "seq_final_reward"])
def test_dynamic_sampling_keeps_only_groups_mixed_on_the_chosen_metric(tmp_path, monkeypatch, metric):
    from detrl import collect

    trained = []  # the groups each step trains on
    real = collect.to_tensors
    monkeypatch.setattr(
        collect, "to_tensors", lambda groups, *a, **k: trained.append(groups) or real(groups, *a, **k)
    )
    rows = run_tiny(tmp_path, "algo=dapo", f"algo.filter_groups.metric={metric}")
    assert len(trained) == 3 and all(len(g) == 8 for g in trained)
    assert all(r["dapo/kept_groups"] == 8 and r["dapo/gen_batches"] >= 1 for r in rows)
    for g in (g for step in trained for g in step):
        values = collect.filter_metric(g, metric)
        assert values.max() != values.min(), (metric, values)


def test_filter_metric_decides_which_groups_are_kept():
    import torch

    from detrl.collect import GroupSource, Scored
    from detrl.rollout import Request, Result

    def group(uid, correct, penalty):
        rs = [Result(Request(uid, k, (1,), 0), [2], [-0.1], "stop") for k in range(len(correct))]
        c = torch.tensor(correct)
        return Scored(rs, c + torch.tensor(penalty), c)

    right_but_one_too_long = group(1, [1.0, 1.0], [0.0, -0.5])  # acc all equal, reward mixed
    wrong_evens_out = group(2, [1.0, 0.0], [-1.0, 0.0])  # acc mixed, reward all 0
    for metric, want in [("acc", [2]), ("score", [2]), ("seq_reward", [1]), ("seq_final_reward", [1])]:
        source = GroupSource(None, None, None, make_cfg("algo=dapo", f"algo.filter_groups.metric={metric}"))
        kept = source.keep([right_but_one_too_long, wrong_evens_out])
        assert [g.results[0].request.prompt_uid for g in kept] == want, metric


def test_dapo_clips_and_clip_ratio_high_changes_the_trajectory(tmp_path):
    # 4 mini-batches of 2 prompts: later mini-batches see a moved policy, so ratios leave [0.8, 1.28]
    extra = ["algo=dapo", "algo.ppo_mini_batch_size=2", "steps=2"]
    a = run_tiny(tmp_path / "a", *extra)
    b = run_tiny(tmp_path / "b", *extra, "algo.clip_ratio_high=0.4")
    assert max(r["actor/pg_clipfrac"] for r in a) > 0
    assert a[0]["fp/rollout_tokens"] == b[0]["fp/rollout_tokens"]  # the same first batch ...
    assert a[0]["fp/params"] != b[0]["fp/params"]  # ... trained differently


def test_dynamic_sampling_gives_up_with_a_clear_error(tmp_path):
    from detrl.trainer import train

    # temperature ~0: every group's samples agree, no group has signal
    cfg = make_cfg(
        "steps=2",
        "train_batch_size=2",
        "rollout.n=3",
        "model.init=random",
        "logger=none",
        "algo=dapo",
        "rollout.top_p=0.000001",
        "algo.filter_groups.max_num_gen_batches=2",
        "algo.overlong.enabled=false",
    )
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


def test_stale_token_modes_change_what_they_should(tmp_path):
    # one mini-batch: for fresh tokens old == current (ratio exactly 1 under determinism=on), so any ppo_kl
    # comes from stale tokens' old logprobs
    runs = {
        mode: run_tiny(
            tmp_path / mode,
            "rollout.partial.enabled=true",
            f"rollout.partial.stale_tokens={mode}",
            "steps=4",
            "algo.ppo_mini_batch_size=0",
        )
        for mode in ("keep", "rescore", "mask")
    }
    stale = [r["partial/staleness_max"] >= 1 for r in runs["keep"]]
    assert any(stale)
    # keep: stale tokens' old = the behaviour logprobs (older weights): the ratio is not 1 on them
    assert all((r["actor/ppo_kl"] != 0.0) == s for r, s in zip(runs["keep"], stale))
    assert all(r["mismatch/stale_logprob_abs_diff"] > 0 for r, s in zip(runs["keep"], stale) if s)
    # rescore: old = the current weights' pass for every token: ratio exactly 1, nothing clipped
    assert all(r["actor/ppo_kl"] == 0.0 and r["actor/pg_clipfrac"] == 0.0 for r in runs["rescore"])
    assert all(r["actor/loss_token_frac"] == 1.0 for r in runs["keep"] + runs["rescore"])
    # mask: stale tokens leave the loss
    assert all(r["actor/ppo_kl"] == 0.0 for r in runs["mask"])
    assert any(r["actor/loss_token_frac"] < 1.0 for r in runs["mask"])
    finals = {mode: rows[-1]["fp/params"] for mode, rows in runs.items()}
    assert len(set(finals.values())) == 3, finals  # three different trainings


@pytest.mark.parametrize("cut", ["groups", "time"])
def test_partial_rollout_off_runs_with_the_async_cut(tmp_path, cut):
    rows = run_tiny(
        tmp_path,
        "rollout.partial.enabled=true",
        "determinism=off",
        "rollout.max_batch_size=4",
        "rollout.partial.oversample=3",
        f"rollout.partial.off_cut={cut}",
        "rollout.partial.time_budget_s=0.001",
    )
    # the cut really is async: requests are aborted wherever they are (24 groups in flight for 8: the first 8
    # to finish, or the 1 ms budget, end the call long before the other requests can finish); whether an
    # aborted sample had sampled a token yet (and so counts as carried) depends on timing, so it is not asserted
    assert all(r["response/aborted_ratio"] > 0 for r in rows)
    assert all(r["dapo/kept_groups"] == 8 and r["partial/buffer_groups"] > 0 for r in rows)


def test_max_staleness_restarts_old_partial_samples(tmp_path):
    rows = run_tiny(
        tmp_path,
        "rollout.partial.enabled=true",
        "rollout.partial.max_staleness=0",
        "rollout.partial.oversample=3",
        "steps=4",
    )
    assert max(r["partial/restarted"] for r in rows) > 0
    assert all(r["partial/staleness_max"] == 0 for r in rows)


def test_bf16_compute_on_cpu_is_true_on_policy_under_on(tmp_path):
    """model.dtype=bfloat16 on CPU: the engine samples from the same bf16 copies the trainer computes with (it
    sampled from the float32 masters before: mismatch ~2e-3), so trainer == rollout logprobs exactly."""
    rows = run_tiny(tmp_path, "model=qwen3_moe", "model.dtype=bfloat16")
    assert all(r["mismatch/train_rollout_logprob_abs_diff"] == 0 for r in rows)
    assert all(r["mismatch/router_agreement"] == 1.0 for r in rows)
