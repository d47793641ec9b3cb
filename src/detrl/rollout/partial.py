"""The partial-rollout buffer: prompt groups in flight across steps, each token stamped with its policy version.

As in slime / xtuner / verl's async mode: a step generates for more groups than it trains on and stops
once enough groups are complete; unfinished samples keep their tokens and continue next step with the
updated weights. `determinism=on` cuts at token-budget round boundaries (deterministic); `off` cuts when
the first groups finish in wall-clock order (as an async engine does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from detrl.rollout.base import Request, Result


@dataclass
class Sample:
    request: Request  # the original request: uid, prompt, sampling seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(
        default_factory=list
    )  # policy version (updates done) that produced each token
    finish: str | None = None  # "stop" | "length"; None while unfinished
    routed_experts: np.ndarray | None = None  # MoE [len(tokens), layers, k]: each call's rows, concatenated

    def continuation(self, budget: int | None) -> Request:
        r = self.request
        return Request(r.prompt_uid, r.sample_index, r.prompt_ids, r.seed, tuple(self.tokens), budget)

    def absorb(self, result: Result, version: int) -> None:
        self.tokens += result.tokens
        self.logprobs += result.logprobs
        self.versions += [version] * len(result.tokens)
        if result.routed_experts is not None:
            prev = self.routed_experts
            self.routed_experts = (
                result.routed_experts if prev is None else np.concatenate([prev, result.routed_experts])
            )
        if result.finish_reason != "abort":
            self.finish = result.finish_reason

    def restart(self) -> None:
        self.tokens, self.logprobs, self.versions, self.finish, self.routed_experts = [], [], [], None, None

    def as_result(self) -> Result:
        return Result(
            self.request, list(self.tokens), list(self.logprobs), self.finish or "abort", self.routed_experts
        )


@dataclass
class Group:
    prompt_uid: int
    answer: str
    samples: list[Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish is not None for s in self.samples)


@dataclass
class PartialBuffer:
    groups: list[Group] = field(default_factory=list)  # in flight, in submission order

    def pending(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples if s.finish is None]

    def carried(self) -> int:
        """Samples holding tokens from an earlier step."""
        return sum(1 for g in self.groups for s in g.samples if s.tokens)

    def restart_stale(self, version: int, max_staleness: int) -> int:
        """Restart samples whose oldest token is more than `max_staleness` versions old (also in complete
        groups that waited for a later step: they would train off-policy)."""
        n = 0
        for g in self.groups:
            for s in g.samples:
                if s.versions and version - min(s.versions) > max_staleness:
                    s.restart()
                    n += 1
        return n

    def take(self, groups: list[Group]) -> None:
        ids = {id(g) for g in groups}
        self.groups = [g for g in self.groups if id(g) not in ids]
