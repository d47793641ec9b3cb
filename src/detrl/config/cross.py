"""The rules that read more than one group, and `validate`: every refusal of a config, run in one place
before anything is built."""

from __future__ import annotations

from typing import TYPE_CHECKING

from detrl.config.base import ConfigError, check

if TYPE_CHECKING:
    from detrl.config.run import TrainConfig


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError (one line) on the first bad value: values no run accepts (detrl.guards), then each
    group's own rules with the cross-group ones after the groups they read."""
    from detrl.guards import check_values

    check_values(cfg)  # non-finite values, zero sizes, a group of one, a warmup as long as the run
    # groups in the order their checks had in one function, so that a config with two bad values is
    # mostly refused for the same one as before (a single bad value always is)
    cfg.model.validate()
    cfg.algo.validate()
    check_algo_rollout(cfg)
    check_batches(cfg)
    cfg.determinism.validate()
    cfg.rollout.validate()
    check_determinism(cfg)
    cfg.data.validate()
    cfg.eval.validate()
    check_data(cfg)
    cfg.logger.validate()
    cfg.validate_keys()
    for group in (cfg.optim, cfg.checkpoint, cfg.warmstart):
        group.validate()


def check_algo_rollout(cfg: TrainConfig) -> None:
    """Routing replay needs an MoE and an engine that records expert ids; the overlong buffer a longer
    response."""
    m, a, r = cfg.model, cfg.algo, cfg.rollout
    if a.routing_replay:
        check(
            m.name == "qwen3_moe",
            "algo.routing_replay",
            a.routing_replay,
            f"model={m.name} is dense, it has no expert routing to replay (use model=qwen3_moe)",
        )
        check(
            r.backend == "embedded",
            "algo.routing_replay",
            a.routing_replay,
            f"rollout={r.backend} does not record expert ids (use rollout=embedded)",
        )
    check(
        a.overlong.buffer_len < r.max_new_tokens or not a.overlong.enabled,
        "algo.overlong.buffer_len",
        a.overlong.buffer_len,
        f"must be < rollout.max_new_tokens={r.max_new_tokens}",
    )


def check_batches(cfg: TrainConfig) -> None:
    """The generation and mini-batch sizes against train_batch_size (prompts)."""
    a, batch = cfg.algo, cfg.train_batch_size
    check(
        a.gen_batch_size == 0 or a.gen_batch_size >= batch,
        "algo.gen_batch_size",
        a.gen_batch_size,
        f"must be 0 (= train_batch_size) or >= train_batch_size={batch}",
    )
    mini = a.ppo_mini_batch_size
    check(
        mini >= 0 and (mini == 0 or mini >= batch or batch % mini == 0),
        "algo.ppo_mini_batch_size",
        mini,
        f"must divide train_batch_size={batch} (prompts; 0 or >= it = the whole batch)",
    )
    if a.old_logprobs == "current":
        check(
            mini == 0 or mini >= batch,
            "algo.ppo_mini_batch_size",
            mini,
            f"must be 0 or >= train_batch_size={batch} (one mini-batch) with algo.old_logprobs=current",
        )


def check_determinism(cfg: TrainConfig) -> None:
    """The sources' combinations that partial rollouts and SGLang cannot run (detrl.determinism.check)."""
    from detrl.determinism import check as check_sources

    r = cfg.rollout
    try:
        check_sources(vars(cfg.determinism), partial=r.partial.enabled, backend=r.backend)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_data(cfg: TrainConfig) -> None:
    """File tasks need a model that knows them; evaluation needs an eval split."""
    m, d, ev = cfg.model, cfg.data, cfg.eval
    if d.name != "arithmetic":
        check(
            m.path is not None or m.init == "random",
            "model.init",
            m.init,
            f"the warm start is for data=arithmetic; with data={d.name} set model.path=/hf/dir or model.init=random",
        )
    check(
        ev.every == 0 or d.name == "arithmetic" or d.eval_path is not None or d.eval_fraction > 0,
        "eval.every",
        ev.every,
        "needs an eval split: set data.eval_path or data.eval_fraction > 0",
    )
