"""MoE routing agreement between the trainer and the rollout engine (R3, "Rollout Routing Replay")."""

from __future__ import annotations

import torch


def layer_agreement(trainer_ids: torch.Tensor, rollout_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the fraction of layers whose top-k expert id sets are equal (order within the k ignored).

    trainer_ids, rollout_ids [..., layers, k] -> [...]. The mean over tokens is the fraction of (token, layer) slots
    that agree (every token has the same number of layers).

    >>> layer_agreement(torch.tensor([[[1, 3], [0, 2]]]), torch.tensor([[[3, 1], [0, 1]]]))
    tensor([0.5000])
    """
    same = (trainer_ids.sort(-1).values == rollout_ids.long().sort(-1).values).all(-1)  # [..., layers]
    return same.float().mean(-1)
