"""Values a run must not accept, and the optimizer step a non-finite gradient must not take.

`check_values` refuses, in one line naming the value and what is valid, settings that would otherwise train
silently wrong (an lr of inf writes NaN into the checkpoint, `rollout.n=1` makes every GRPO advantage 0, a warmup
as long as the run keeps the lr at 0) or crash with a traceback (a model with no layers). `finite_step` skips
the optimizer step when the gradient norm is NaN or inf, as verl's actor does, counts it
(`actor/nonfinite_grad_steps`), and stops the run in one line after `optim.max_nonfinite_grad_steps` in a row.
`stop_on_signals` turns SIGINT / SIGTERM into a clean stop: the step's log and checkpoint are finished (a signal
during them checkpoints that step), W&B is finished, and the entrypoint prints how to resume.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

from detrl.config.base import ConfigError

if TYPE_CHECKING:  # config validation imports this module: no torch import, no config import, at that point
    import torch

    from detrl.config import TrainConfig

GROUP_ESTIMATORS = ("grpo",)  # advantages relative to the prompt's group: one sample is its own baseline
# floats for which inf is no setting (NaN is refused everywhere)
FINITE = (
    "lr",
    "weight_decay",
    "rollout.temperature",
    "rollout.top_p",
    "eval.temperature",
    "algo.kl_loss_coef",
    "algo.entropy_coeff",
    "algo.clip_ratio_low",
    "algo.clip_ratio_high",
    "algo.clip_ratio_c",
    "warmstart.lr",
    "warmstart.label_smoothing",
    "optim.num_cycles",
    "optim.min_lr_ratio",
)
AT_LEAST_ONE = (  # sizes a model or a run cannot have 0 of
    "steps",
    "model.vocab_size",
    "model.hidden_size",
    "model.intermediate_size",
    "model.num_hidden_layers",
    "model.num_attention_heads",
    "model.num_key_value_heads",
    "model.head_dim",
    "model.max_position_embeddings",
    "optim.max_nonfinite_grad_steps",
)
NON_NEGATIVE = ("algo.kl_loss_coef", "warmstart.steps", "optim.num_cycles", "rollout.sglang.retries")


class NonFiniteGradients(ConfigError):
    """The gradient norm was NaN or inf for too many optimizer steps in a row (one line)."""


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _floats(obj: Any, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _floats(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value


def _refuse(where: str, value: Any, rule: str) -> None:
    raise ConfigError(f"{where}={value!r} is not valid: {rule}")


def check_values(cfg: TrainConfig) -> None:
    """Raise ConfigError (one line) on the first value no run should accept."""
    for where, value in _floats(cfg):
        if math.isnan(value) or (math.isinf(value) and where in FINITE):
            _refuse(where, value, "must be a finite number")
    for where in AT_LEAST_ONE:
        if _get(cfg, where) < 1:
            _refuse(where, _get(cfg, where), "must be >= 1")
    for where in NON_NEGATIVE:
        if _get(cfg, where) < 0:
            _refuse(where, _get(cfg, where), "must be >= 0")
    if cfg.algo.adv_estimator in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        _refuse(
            "rollout.n",
            cfg.rollout.n,
            f"must be >= 2 with algo.adv_estimator={cfg.algo.adv_estimator} (a group of one has advantage 0)",
        )
    o = cfg.optim
    warmup = int(o.lr_warmup_steps_ratio * cfg.steps) if o.lr_warmup_steps < 0 else o.lr_warmup_steps
    if warmup >= cfg.steps:
        where, value = (
            ("optim.lr_warmup_steps", o.lr_warmup_steps)
            if o.lr_warmup_steps >= 0
            else ("optim.lr_warmup_steps_ratio", o.lr_warmup_steps_ratio)
        )
        _refuse(where, value, f"the warmup ({warmup} steps) must be shorter than steps={cfg.steps}")


def check_context(longest_prompt: int, max_new_tokens: int, positions: int, where: str) -> None:
    """The longest prompt plus the response must fit the model's positions (one line naming the fixes)."""
    if longest_prompt + max_new_tokens > positions:
        raise ConfigError(
            f"model.max_position_embeddings={positions} is too small: {where} has {longest_prompt} prompt tokens "
            f"+ rollout.max_new_tokens={max_new_tokens}; set data.max_prompt_length<="
            f"{max(positions - max_new_tokens, 0)} (drops longer prompts), fewer new tokens or more positions"
        )


def finite_step(opt: torch.optim.Optimizer, grad_norm: float, max_in_a_row: int) -> None:
    """opt.step() when the gradient norm is finite; else skip it and count it. Stop after `max_in_a_row`
    non-finite norms in a row (NonFiniteGradients, one line)."""
    counts = opt.__dict__.setdefault("nonfinite_grad_steps", [0, 0])  # [since the last pop, in a row]
    if math.isfinite(float(grad_norm)):
        counts[1] = 0
        opt.step()
        return
    counts[0] += 1
    counts[1] += 1
    if counts[1] >= max_in_a_row:
        raise NonFiniteGradients(
            f"stopped: the gradient norm was {float(grad_norm)} for {counts[1]} optimizer steps in a row "
            f"(optim.max_nonfinite_grad_steps={max_in_a_row}); each was skipped. Lower lr or check the data; "
            "resume=auto continues from the last checkpoint"
        )


def pop_nonfinite(opt: torch.optim.Optimizer) -> float:
    """Optimizer steps skipped for a non-finite gradient norm since the last call (`actor/nonfinite_grad_steps`)."""
    counts = opt.__dict__.setdefault("nonfinite_grad_steps", [0, 0])
    n, counts[0] = counts[0], 0
    return float(n)


# --- SIGINT / SIGTERM: stop cleanly, resumable

_SIGNALS = {"pid": None, "pending": None, "held": 0}


class Interrupted(BaseException):  # noqa: N818 - as KeyboardInterrupt: no `except Exception` swallows it
    """SIGINT or SIGTERM reached the run (raised at once, or at the end of a held section)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name = signum, signal.Signals(signum).name


def _on_signal(signum, frame) -> None:
    if os.getpid() != _SIGNALS["pid"] or _SIGNALS["pending"] is not None:
        return  # a forked engine worker (its parent decides), or already stopping: let the cleanup finish
    _SIGNALS["pending"] = signum
    if not _SIGNALS["held"]:
        raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals():
    """Within: SIGINT and SIGTERM raise `Interrupted` in this process (the step in progress is dropped; the
    `finally` blocks close the engine and finish W&B), or wait for the end of a `hold_signals` section. Later
    signals are ignored while it stops. Forked workers inherit the handler and ignore them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _SIGNALS.update(pid=os.getpid(), pending=None, held=0)
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _SIGNALS.update(pid=None, pending=None, held=0)


class hold_signals:  # noqa: N801 - used as a function
    """A section a signal must not cut (a step's log and checkpoint): one that arrives waits for `release()`,
    and `requested` tells the section to checkpoint before it ends."""

    def __init__(self):
        _SIGNALS["held"] += 1

    @property
    def requested(self) -> bool:
        return _SIGNALS["pending"] is not None

    def release(self) -> None:
        _SIGNALS["held"] = max(0, _SIGNALS["held"] - 1)
        if _SIGNALS["pending"] is not None and not _SIGNALS["held"] and _SIGNALS["pid"] == os.getpid():
            raise Interrupted(_SIGNALS["pending"])
