"""What every rollout engine takes and returns (embedded now; SGLang later, same shapes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 4
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Request:
    prompt_uid: int  # f(seed, data position): stable across runs
    sample_index: int  # index within the prompt's group
    prompt_ids: tuple[int, ...]
    seed: int | None = None  # per-sample sampling seed; None = the engine's shared RNG stream
    prefix: tuple[int, ...] = ()  # response tokens already generated (a partial rollout carried over)
    max_new_tokens: int | None = None  # new tokens allowed in this call (None: up to the sampling limit)

    @property
    def uid(self) -> tuple[int, int]:
        return (self.prompt_uid, self.sample_index)


@dataclass
class Result:
    request: Request
    tokens: list[int]  # tokens sampled in this call (after any prefix), the stop token included
    logprobs: list[float]  # log pi_rollout(token) after temperature, before top-p (SGLang's convention)
    finish_reason: str  # "stop" | "length" | "abort" (cut unfinished: continue it later)
    # MoE: [T, layers, k] int16, row t the experts each layer routed the pass that sampled token t to (its input
    # is the token before t); None for dense models and engines that do not record (SGLang, the CUDA engine)
    routed_experts: np.ndarray | None = None

    @property
    def uid(self) -> tuple[int, int]:
        return self.request.uid


def cut_results(
    requests: list[Request],
    tokens: list[list[int]],
    logprobs: list[list[float]],
    limit: list[int],
    room: list[int],
    stop_token_ids: tuple[int, ...],
    experts: np.ndarray | None = None,
) -> list[Result]:
    """An engine batch's sampled matrices [B, T] -> one Result per request: each row cut at its first stop token
    ("stop"), else at its token limit for this call: "length" when that is all the room it had, else "abort"
    (a budgeted partial-rollout call; it continues later). experts [B, T, layers, k]: the routing, cut alike."""
    stop_set = set(stop_token_ids)
    out = []
    for i, r in enumerate(requests):
        row = tokens[i][: limit[i]]
        n = next((j + 1 for j, x in enumerate(row) if x in stop_set), len(row))
        reason = "stop" if n and row[n - 1] in stop_set else "length" if n >= room[i] else "abort"
        out.append(
            Result(r, row[:n], logprobs[i][:n], reason, None if experts is None else experts[i, :n].copy())
        )
    return out


class Engine(Protocol):
    """What the trainer, the evaluator and the server call; every engine implements it."""

    generator: torch.Generator  # the stream of unseeded requests (a checkpoint saves its state)
    params: SamplingParams  # the sampling a call without its own uses (read-only to callers)

    def generate(
        self,
        requests: list[Request],
        params: SamplingParams | None = None,
        stop_when: Callable[[list[Result]], bool] | None = None,
    ) -> list[Result]:
        """Sample every request with `params` (None: the engine's own); fixed routing returns results in request
        order, else in completion order. stop_when: cut the call once it is true of the results so far."""
        ...

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """The policy's new weights: a state dict or (name, tensor) pairs."""
        ...

    def abort(self) -> None:
        """Cut the call in flight: running requests return what they sampled, queued ones nothing."""
        ...

    def close(self) -> None: ...
