"""update(): micro-batching, mini-batches and the chunked logprobs against one-batch references."""

import pytest
import torch

from detrl.algos import agg_loss, compute_policy_loss, kl_penalty
from detrl.collect import StepBatch
from detrl.config import ModelConfig
from detrl.models import BATCH_INVARIANT_OPS, DEFAULT_OPS, build_model
from detrl.models.forward import forward, rope_tables, token_logprobs
from detrl.models.logprobs import sequence_logprobs
from tests.conftest import make_cfg

L, N, P = 16, 8, 5  # ctx_len, sequences (2 groups of 4), prompt tokens
OPS = {"on": BATCH_INVARIANT_OPS, "off": DEFAULT_OPS}


def _batch(seed=0) -> tuple[StepBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 64, (N, L), generator=g)
    mask = torch.zeros(N, L - 1)
    for i in range(N):  # responses of different lengths, some ending before the context does
        mask[i, P - 1 : P - 1 + 3 + i % 7] = 1.0
    versions = torch.where(mask > 0, 0, -1)
    batch = StepBatch(
        [], torch.zeros(N), torch.zeros(N), torch.arange(N) // 4, ids, mask, torch.zeros(N, L - 1), versions
    )
    return batch, torch.randn(N, generator=g)


class _Recorder:
    """An optimizer that records the gradient of each step and leaves the weights alone."""

    def __init__(self, params):
        self.params = list(params)
        self.param_groups = [{"lr": 0.0}]
        self.grads: list[list[torch.Tensor]] = []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.grads.append(
            [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]
        )


def _cfg(*extra):
    return make_cfg(
        "train_batch_size=2", "rollout.n=4", "grad_clip=1e9", "algo.ppo_mini_batch_size=0", *extra
    )


def _update(model, ref, cfg, det):
    from tests.actor_helpers import update

    batch, adv = _batch()
    opt = _Recorder(model.parameters())
    m = update(model, ref, opt, batch, adv, cfg, OPS[det], L, rope_tables(model.config, L), version=0)
    return opt.grads, m


def _reference_grad(model, ref, cfg, det):
    """Today's (pre-mini-batch) update on the whole batch at once: old = current logprobs (ratio 1), one
    backward of the full [N, L, V] path with this batch's denominators."""
    a, ops, rope = cfg.algo, OPS[det], rope_tables(model.config, L)
    batch, adv = _batch()
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(
        forward(model, batch.input_ids, ops, L, rope)[:, :-1], batch.input_ids[:, 1:], 1.0
    )
    logp = logp * batch.mask
    pg, _ = compute_policy_loss(
        logp,
        logp.detach(),
        adv[:, None].expand_as(logp),
        batch.mask,
        a.clip_ratio_low,
        a.clip_ratio_high,
        a.clip_ratio_c,
    )
    agg = dict(mode=a.loss_agg_mode, loss_scale_factor=cfg.rollout.max_new_tokens, global_batch_size=N)
    loss = agg_loss(pg, batch.mask, **agg)
    if ref is not None:
        with torch.no_grad():
            rl, _ = token_logprobs(
                forward(ref, batch.input_ids, ops, L, rope)[:, :-1], batch.input_ids[:, 1:], 1.0
            )
        loss = loss + a.kl_loss_coef * agg_loss(
            kl_penalty(logp, rl * batch.mask, a.kl_loss_type), batch.mask, **agg
        )
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("det", ["on", "off"])
@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum-norm", "token-sum"]
)
def test_gradient_equals_the_one_batch_reference_for_any_micro_batch_size(det, mode):
    model = build_model(ModelConfig(), seed=0)
    ref = build_model(ModelConfig(), seed=1).requires_grad_(False)
    ref_grad = None
    for micro in (1, 3, N):
        cfg = _cfg(f"micro_batch_size={micro}", f"algo.loss_agg_mode={mode}", "algo.kl_loss_coef=0.1")
        if ref_grad is None:
            ref_grad = _reference_grad(model, ref, cfg, det)
        grads, m = _update(model, ref, cfg, det)
        assert len(grads) == 1 and m["actor/optimizer_steps"] == 1.0
        assert m["actor/ppo_kl"] == 0.0 and m["actor/pg_clipfrac"] == 0.0  # one mini-batch: old == current
        for g, r in zip(grads[0], ref_grad, strict=True):
            # fp32 gradient accumulation sums the micro-batches' weight gradients in another order than one
            # gemm over all rows does, so across micro-batch sizes equal up to rounding, not bitwise
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()))
    assert any(g.abs().sum() > 0 for g in ref_grad)  # not vacuous


def test_mini_batches_and_epochs_are_optimizer_steps():
    model = build_model(ModelConfig(), seed=0)
    grads, m = _update(model, None, _cfg("algo.ppo_mini_batch_size=1", "algo.ppo_epochs=3"), "on")
    assert len(grads) == 6 and m["actor/optimizer_steps"] == 6.0  # 2 mini-batches (1 prompt = 4 seqs) x 3


@pytest.mark.parametrize("model_name", ["qwen3", "qwen3_moe"])
def test_chunked_logprobs_are_the_full_paths_bits_under_batch_invariant_ops(model_name):
    model = build_model(ModelConfig(name=model_name), seed=0)
    batch, _ = _batch()
    rope = rope_tables(model.config, L)
    with torch.no_grad():
        full, dist = token_logprobs(
            forward(model, batch.input_ids, BATCH_INVARIANT_OPS, L, rope)[:, :-1], batch.input_ids[:, 1:], 0.7
        )
        for chunk in (None, 16, 48):
            lp, ent = sequence_logprobs(
                model,
                batch.input_ids,
                batch.mask,
                BATCH_INVARIANT_OPS,
                L,
                rope,
                0.7,
                entropy=True,
                chunk=chunk,
            )
            assert torch.equal(lp, full * batch.mask)
            want = -(dist.exp() * dist).sum(-1) * batch.mask
            torch.testing.assert_close(ent, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stale", ["keep", "mask", "rescore"])
def test_old_logprobs_current_gives_the_recompute_passes_bits_under_batch_invariant_ops(stale):
    """algo.old_logprobs=current skips the old pass and takes each micro-batch's gradient-pass logprobs: at one
    epoch of one mini-batch these are the same weights, so under `on` the gradients and every metric are the
    bits of the separate pass (stale partial tokens included: versions -1 on some rows)."""
    from tests.actor_helpers import update

    model = build_model(ModelConfig(), seed=0)
    ref = build_model(ModelConfig(), seed=1).requires_grad_(False)
    batch, adv = _batch()
    batch.versions[::3] = torch.where(batch.mask[::3] > 0, -1, batch.versions[::3])  # stale rows
    batch.rollout_logp = (
        -torch.rand(batch.mask.shape, generator=torch.Generator().manual_seed(1)) * batch.mask
    )
    rope = rope_tables(model.config, L)
    runs = {}
    for old in ("recompute", "current"):
        cfg = _cfg(
            "micro_batch_size=3",
            "algo.kl_loss_coef=0.1",
            f"algo.old_logprobs={old}",
            f"rollout.partial.stale_tokens={stale}",
        )
        opt = _Recorder(model.parameters())
        runs[old] = (
            opt.grads,
            update(model, ref, opt, batch, adv, cfg, BATCH_INVARIANT_OPS, L, rope, version=0),
        )
    (g_re, m_re), (g_cur, m_cur) = runs["recompute"], runs["current"]
    assert all(torch.equal(a, b) for a, b in zip(g_re[0], g_cur[0], strict=True))
    assert m_re == m_cur
    assert m_re["mismatch/train_rollout_logprob_abs_diff"] > 0 and m_re["actor/entropy"] > 0  # not vacuous


def test_old_logprobs_current_needs_one_update_per_batch():
    from detrl.config import ConfigError

    for bad, field in (
        ("algo.ppo_epochs=2", "algo.ppo_epochs"),
        ("algo.ppo_mini_batch_size=1", "algo.ppo_mini_batch_size"),
        ("algo.rollout_correction=tis", "algo.rollout_correction"),
    ):
        with pytest.raises(ConfigError, match=rf"^{field}="):
            make_cfg("train_batch_size=2", "algo.old_logprobs=current", bad)


@pytest.mark.parametrize("case", ["all_stale_masked", "empty_response_alone"])
def test_old_logprobs_current_where_no_token_trains_is_recompute(case):
    """Micro-batches in which no token trains: `current` still scores them (their old logprobs feed the metrics)
    but without a backward, as `recompute` skips them: the same metrics (no 0/0), no crash on a row without
    response tokens, and under AdamW with weight decay the same parameters (no zero gradients that decay them)."""
    import math

    from tests.actor_helpers import update

    batch, adv = _batch()
    if case == "all_stale_masked":  # every token stale and masked: nothing trains in any micro-batch
        batch.versions[:] = -1
        extra = ("micro_batch_size=3", "rollout.partial.stale_tokens=mask")
    else:  # a row without response tokens, alone in its micro-batch
        batch.mask[0] = 0
        batch.versions[0] = -1
        extra = ("micro_batch_size=1",)
    runs = {}
    for old in ("recompute", "current"):
        model = build_model(ModelConfig(), seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        m = update(
            model,
            None,
            opt,
            batch,
            adv,
            _cfg(*extra, f"algo.old_logprobs={old}"),
            BATCH_INVARIANT_OPS,
            L,
            rope_tables(model.config, L),
            version=0,
        )
        runs[old] = m, [p.detach().clone() for p in model.parameters()]
    (m_re, p_re), (m_cur, p_cur) = runs["recompute"], runs["current"]
    assert m_re.keys() == m_cur.keys()
    assert not any(isinstance(v, float) and math.isnan(v) for v in m_cur.values()), m_cur
    assert m_re == m_cur
    assert all(torch.equal(a, b) for a, b in zip(p_re, p_cur, strict=True))
    if case == "all_stale_masked":
        fresh = build_model(ModelConfig(), seed=0)
        assert all(
            torch.equal(a, b) for a, b in zip(p_cur, fresh.parameters())
        )  # nothing trained: nothing moved
