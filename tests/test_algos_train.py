"""The new algorithm options train end to end, bitwise reproducibly under determinism=on, and move the weights
differently from the default."""

import pytest

from tests.conftest import read_metrics, run_tiny

FP_KEYS = ["fp/params", "fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order"]
SHORT = ["steps=2", "algo.ppo_mini_batch_size=4", "micro_batch_size=12"]

# every new option; two runs each with different engine layouts must agree at every fingerprint
OPTIONS = [
    ["algo=gspo", "model=qwen3_moe"],
    ["algo=rloo"],
    ["algo.adv_estimator=rloo"],
    ["algo.adv_estimator=reinforce_plus_plus", "algo.gamma=0.9"],
    ["algo.adv_estimator=reinforce_plus_plus_baseline"],
    ["algo.adv_estimator=opo"],
    ["algo.adv_estimator=gpg"],
    ["algo.adv_estimator=grpo_passk"],
    ["algo.scale_rewards=batch"],
    ["algo.policy_loss=cispo"],
    ["algo.policy_loss=sapo"],
    ["algo.policy_loss=gpg"],
    ["algo.policy_loss=geo_mean"],
    [
        "algo.policy_loss=clip_cov",
        "algo.policy_loss_args.clip_cov_ratio=0.1",
        "algo.policy_loss_args.clip_cov_lb=-1",
    ],
    ["algo.policy_loss=kl_cov", "algo.policy_loss_args.kl_cov_ratio=0.1"],
    ["algo.kl_loss_type=low_var_kl+", "algo.kl_loss_coef=0.5"],
    ["algo.use_kl_in_reward=true", "algo.kl_ctrl.kl_coef=0.5"],
    [
        "algo.use_kl_in_reward=true",
        "algo.kl_ctrl.type=adaptive",
        "algo.kl_ctrl.horizon=10",
        "algo.kl_ctrl.kl_coef=0.5",
    ],
    ["algo.loss_agg_mode=token-sum"],
]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return run_tiny(tmp_path_factory.mktemp("default"), *SHORT)


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(o))
def test_option_trains_reproducibly_and_differs_from_the_default(tmp_path, opts, default_run):
    a = run_tiny(tmp_path / "a", *SHORT, *opts, "rollout.num_workers=2")
    b = run_tiny(tmp_path / "b", *SHORT, *opts, "rollout.num_workers=3", "rollout.max_batch_size=5")
    assert [[r[k] for k in FP_KEYS] for r in a] == [[r[k] for k in FP_KEYS] for r in b]
    assert len({r["fp/params"] for r in a}) == 2  # the weights moved every step
    assert a[-1]["fp/params"] != default_run[-1]["fp/params"]  # the option changed the update
    assert all(set(r) == set(a[0]) for r in a)


def test_rejection_and_batch_normalised_weights_are_exact_no_ops_under_on(tmp_path, default_run):
    rows = run_tiny(
        tmp_path,
        *SHORT,
        "algo.rollout_correction=tis",
        "algo.rollout_corr.rollout_is_batch_normalize=true",
        "algo.rollout_corr.rollout_rs='token_k1,seq_sum_k1,seq_mean_k3,seq_max_k2'",
        "algo.rollout_corr.rollout_rs_threshold='1.0_1.0,1.0_1.0,1e-12,1e-12'",  # only ratio 1 passes
    )
    assert [[r[k] for k in FP_KEYS] for r in rows] == [[r[k] for k in FP_KEYS] for r in default_run]
    assert all(r["rollout_corr/rejected_frac"] == 0.0 and r["actor/loss_token_frac"] == 1.0 for r in rows)


def test_rejection_under_off_leaves_the_loss(tmp_path):
    rows = run_tiny(
        tmp_path,
        *SHORT,
        "determinism=off",
        "algo.rollout_corr.rollout_rs=token_k2",
        "algo.rollout_corr.rollout_rs_threshold='1e-30'",  # any mismatch at all is rejected
    )
    frac = [r["rollout_corr/rejected_frac"] for r in rows]
    assert all(f == pytest.approx(1.0 - r["actor/loss_token_frac"]) for f, r in zip(frac, rows))
    assert any(f > 0 for f in frac)  # off's batch variance differs somewhere (float32, ~1e-7)


def test_adaptive_kl_coef_moves_and_is_logged(tmp_path):
    rows = run_tiny(
        tmp_path,
        *SHORT,
        "steps=3",
        "algo.use_kl_in_reward=true",
        "algo.kl_ctrl.type=adaptive",
        "algo.kl_ctrl.horizon=10",
    )
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in rows]
    assert coefs[0] == 0.001 and len(set(coefs)) == 3  # beta follows the KL every step


def test_adaptive_kl_coef_resumes_exactly(tmp_path):
    opts = [*SHORT, "algo.use_kl_in_reward=true", "algo.kl_ctrl.type=adaptive", "algo.kl_ctrl.horizon=10"]
    full = run_tiny(tmp_path / "full", *opts, "steps=3")
    run_tiny(tmp_path / "part", *opts, "steps=3", "checkpoint.every=1")
    part = tmp_path / "part"
    # cut the run after step 2 and resume it
    import shutil

    shutil.rmtree(part / "checkpoints" / "step-000003")
    (part / "summary.json").unlink()
    resumed = run_tiny(part, *opts, "steps=3", "resume=auto")
    assert resumed[-1]["actor/reward_kl_penalty_coeff"] == full[-1]["actor/reward_kl_penalty_coeff"]
    assert resumed[-1]["fp/params"] == full[-1]["fp/params"]
    assert len(read_metrics(part)) == 3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("algo.policy_loss=ppo", "algo.policy_loss='ppo' is not valid; choose one of ['vanilla', 'gspo'"),
        ("algo.adv_estimator=gae", "algo.adv_estimator='gae' is not valid; choose one of ['grpo'"),
        ("algo.kl_loss_type=k4+", "algo.kl_loss_type='k4+' is not valid; choose one of ['kl'"),
        ("algo.loss_agg_mode=sum", "algo.loss_agg_mode='sum' is not valid; choose one of ['token-mean'"),
        (
            "algo.rollout_corr.rollout_rs=token_k4",
            "algo.rollout_corr.rollout_rs='token_k4' is not valid; choose a",
        ),
    ],
)
def test_a_bad_name_fails_in_one_line(override, needle):
    from detrl.config import ConfigError
    from tests.conftest import make_cfg

    with pytest.raises(ConfigError) as e:
        make_cfg(override)
    assert needle in str(e.value) and "\n" not in str(e.value)
