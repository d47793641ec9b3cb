"""The determinism group (`conf/determinism/{on,off}.yaml`): the preset and the value of each source."""

from __future__ import annotations

from dataclasses import dataclass

from detrl.config.base import check, choice


@dataclass
class DeterminismConfig:
    """The preset (conf/determinism/{on,off}.yaml) and the value of each source of nondeterminism; the values
    and what each means: detrl.determinism.SOURCES. One override flips one source:
    `python train.py determinism=on determinism.kernels=default`."""

    name: str = "on"  # the preset the values started from: on | off
    sampling: str = "seeded"  # seeded | stream
    routing: str = "fixed"  # fixed | dynamic
    kernels: str = "batch_invariant"  # batch_invariant | default
    order: str = "submission"  # submission | completion
    moe_routing: str = "stable"  # stable | topk
    torch_algorithms: str = "deterministic"  # deterministic | default
    cut: str = "token_budget"  # partial rollout: token_budget | async
    reduce: str = "ordered"  # torchrun gradients: ordered | all_reduce

    def validate(self) -> None:
        """The preset's name and each source's value (detrl.determinism.SOURCES); the combinations that
        depend on the rollout are cross-group (detrl.config.cross)."""
        from detrl.determinism import PRESETS, SOURCES

        check(self.name in PRESETS, "determinism", self.name, f"choose one of {list(PRESETS)}")
        for source, values in SOURCES.items():
            choice(f"determinism.{source}", getattr(self, source), values)
