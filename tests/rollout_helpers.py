"""What the engine tests share: the tiny models (built once per process), seeded prompt groups, a result's bits."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from detrl.config import ModelConfig
from detrl.determinism import Determinism, preset
from detrl.models import build_model
from detrl.rollout import Request

EOS = 2


@cache
def tiny_model(name: str):
    """The default shape of `name` (qwen3, qwen3_moe), seed 0; one instance per process: do not modify it."""
    return build_model(ModelConfig(name=name), seed=0)


def group_requests(groups: int, n: int, prompt: Callable[[int], tuple[int, ...]], seeded: bool = True):
    """n samples of each prompt g < groups (`prompt(g)` its tokens), seeded as a run seeds step 1 under
    determinism on (seed 0); unseeded ones draw from the engine's stream."""
    det = Determinism(preset("on"), seed=0)
    return [
        Request(g, j, prompt(g), det.sampling_seed(1, g, j) if seeded else None)
        for g in range(groups)
        for j in range(n)
    ]


def bits(results) -> list[tuple]:
    """Everything a result carries, comparable with ==: uid, tokens, logprobs, finish reason, routing bytes."""
    return [
        (
            r.uid,
            r.tokens,
            r.logprobs,
            r.finish_reason,
            None if r.routed_experts is None else r.routed_experts.tobytes(),
        )
        for r in results
    ]
