"""DAPO's pieces: dynamic sampling (drop all-equal groups) and overlong reward shaping."""

from __future__ import annotations

import math

import torch


def filter_groups(scores: list[float], group_ids: list[int]) -> list[int]:
    """Group ids (in first-seen order) whose rewards are not all equal; a group of one is kept.

    As verl's DAPO trainer (verl-recipe dapo/dapo_ray_trainer.py @ 48ea0a7: keep if std > 0 or a group of one),
    a group with a NaN metric is dropped (its std is NaN, and NaN > 0 is false).

    >>> filter_groups([1., 1., 0., 1., float("nan"), 1.], [7, 7, 9, 9, 4, 4])
    [9]
    """
    by_group: dict[int, list[float]] = {}
    for s, g in zip(scores, group_ids, strict=True):
        by_group.setdefault(g, []).append(s)
    return [
        g
        for g, r in by_group.items()
        if len(r) == 1 or (not any(math.isnan(x) for x in r) and max(r) != min(r))
    ]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float) -> torch.Tensor:
    """Linear penalty in the last `buffer_len` tokens before `max_len`; 0 before it, -factor at max_len.

    >>> overlong_penalty(torch.tensor([2, 3, 4]), max_len=4, buffer_len=2, factor=1.0)
    tensor([ 0.0000, -0.5000, -1.0000])
    """
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    expected = max_len - buffer_len
    exceed = lengths.float() - expected
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)
