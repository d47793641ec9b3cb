"""The one place that decides what determinism means: each source of nondeterminism has a switch, and
`determinism=on` / `off` are presets that set all of them. Everything else asks this module.

| source (`determinism.<key>`) | off value: as real systems run          | on value                                    |
|------------------------------|-----------------------------------------|---------------------------------------------|
| sampling                     | stream: each worker's RNG stream, in    | seeded: per-sample seed =                   |
|                              | the order its batches run               | hash(seed, step, uid, idx)                  |
| routing (requests -> workers | dynamic: prompt groups to the worker    | fixed: worker j its j-th contiguous share   |
|   and ranks: the schedule)   | with the fewest in flight as results    | of groups in one message (its continuous    |
|                              | return (the running batch's make-up     | batches a function of the requests); group  |
|                              | follows the timing); ranks claim groups | i -> rank i W // G                          |
|                              | from a shared queue                     |                                             |
| kernels                      | default: F.linear / SDPA / F.silu /     | batch_invariant: detrl.models.ops (proven   |
|                              | grouped MoE (torch's, by device)        | before step 0 by the preflight)             |
| order (results -> trainer)   | completion: as the engine returns them  | submission: (data position, sample index)   |
| moe_routing                  | topk: torch.topk (ties as the kernel    | stable: stable sort, ties -> lowest expert  |
|                              | breaks them)                            | id                                          |
| torch_algorithms             | default: torch's defaults (CPU          | deterministic: use_deterministic_algorithms,|
|                              | embedding backward, cuDNN benchmark,    | cuBLAS workspace, TF32 off                  |
|                              | TF32)                                   |                                             |
| cut (partial rollout)        | async: when the first groups finish or  | token_budget: every pending sample advances |
|                              | at a wall-clock budget (off_cut)        | by at most token_budget tokens per round    |
| reduce (torchrun gradients)  | all_reduce: each rank a contiguous 1/W  | ordered: virtual micro-batch k -> rank k%W, |
|                              | of a mini-batch, averaged by all-reduce | gradients summed in micro-batch order       |

One override flips one source: `python train.py determinism=on determinism.kernels=default`. `check()` refuses
the combinations that cannot work, in one line. Every mode seeds python, numpy and torch from the run seed:
an off value releases a pin, it never adds noise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import struct
from dataclasses import dataclass

import numpy as np
import torch

from detrl.rollout.base import Request, Result

# source -> (on value, off value)
SOURCES: dict[str, tuple[str, str]] = {
    "sampling": ("seeded", "stream"),
    "routing": ("fixed", "dynamic"),
    "kernels": ("batch_invariant", "default"),
    "order": ("submission", "completion"),
    "moe_routing": ("stable", "topk"),
    "torch_algorithms": ("deterministic", "default"),
    "cut": ("token_budget", "async"),
    "reduce": ("ordered", "all_reduce"),
}
PRESETS = ("on", "off")


def preset(name: str) -> dict[str, str]:
    """The value of every source under the preset `name` (on | off)."""
    if name not in PRESETS:
        raise ValueError(f"determinism={name!r} is not valid; choose one of {list(PRESETS)}")
    return {s: vals[PRESETS.index(name)] for s, vals in SOURCES.items()}


def flipped(sources: dict[str, str], name: str) -> list[str]:
    """The sources whose value differs from the preset `name`, as `source=value` (empty: the plain preset)."""
    base = preset(name)
    return [f"{s}={sources[s]}" for s in SOURCES if sources[s] != base[s]]


def label(det: dict) -> str | None:
    """The preset, plus each source set away from it: "on", "off", "on-kernels=default". A config without the
    per-source keys (from before they existed) is its preset; None or another name is returned as it is."""
    name = det.get("name")
    if name not in PRESETS:
        return name
    return "-".join([name, *flipped({s: det.get(s, v) for s, v in preset(name).items()}, name)])


def check(sources: dict[str, str], *, partial: bool = False, backend: str = "embedded") -> None:
    """Refuse values and combinations that cannot work, with one line (ValueError; config.validate re-raises it
    as a ConfigError)."""
    for s, vals in SOURCES.items():
        if sources[s] not in vals:
            raise ValueError(f"determinism.{s}={sources[s]!r} is not valid; choose one of {list(vals)}")
    if partial and sources["cut"] == "async" and sources["routing"] == "fixed":
        raise ValueError(
            "determinism.cut='async' is not valid with determinism.routing='fixed': the engine cuts "
            "running batches by the clock only when batches are dynamic; set determinism.routing=dynamic"
        )
    if backend == "sglang" and (sources["sampling"] == "seeded") != (sources["kernels"] == "batch_invariant"):
        raise ValueError(
            f"determinism.sampling={sources['sampling']!r} is not valid with determinism.kernels="
            f"{sources['kernels']!r} on rollout=sglang: one server flag (--enable-deterministic-inference)"
            " sets both; choose seeded + batch_invariant or stream + default"
        )
    if backend == "sglang" and partial and sources["cut"] == "async":
        raise ValueError(
            "determinism.cut='async' is not valid with rollout=sglang: its partial-rollout cut is "
            "the token budget; set determinism.cut=token_budget"
        )


def stable_hash(*parts: int | str) -> int:
    """A 63-bit hash of the parts, stable across processes and machines (unlike `hash`)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\x00")
    return struct.unpack("<Q", h.digest())[0] >> 1


def _sources(mode) -> dict[str, str]:
    """bool (all on / all off), a preset name, or a mapping with every source (a DeterminismConfig's fields)."""
    if isinstance(mode, bool):
        return preset("on" if mode else "off")
    if isinstance(mode, str):
        return preset(mode)
    values = mode if isinstance(mode, dict) else dataclasses.asdict(mode)
    return {s: values[s] for s in SOURCES}


@dataclass(frozen=True, eq=False)
class Determinism:
    sources: dict[str, str]  # every key of SOURCES -> its value
    seed: int

    def _on(self, source: str) -> bool:
        return self.sources[source] == SOURCES[source][0]

    @property
    def seeded_sampling(self) -> bool:
        return self._on("sampling")

    @property
    def fixed_routing(self) -> bool:
        """fixed: each worker its contiguous share of the groups at once; dynamic: shortest queue, by timing."""
        return self._on("routing")

    @property
    def invariant_kernels(self) -> bool:
        return self._on("kernels")

    @property
    def submission_order(self) -> bool:
        return self._on("order")

    @property
    def budget_cut(self) -> bool:
        """Partial rollout: cut every round at the token budget (else by time / first groups done)."""
        return self._on("cut")

    @property
    def ordered_reduce(self) -> bool:
        return self._on("reduce")

    @property
    def stable_routing(self) -> bool:
        """MoE routing by stable sort (ties -> lowest expert id) rather than torch.topk."""
        return self._on("moe_routing")

    def prompt_uid(self, data_position: int) -> int:
        """Stable id of the prompt at a data position (the same in every mode: ids are ids)."""
        return stable_hash("prompt", self.seed, data_position)

    def sampling_seed(self, step: int, prompt_uid: int, sample_index: int) -> int | None:
        """Per-sample seed when sampling is seeded; None (the engine's streams) otherwise."""
        if not self.seeded_sampling:
            return None
        return stable_hash("sample", self.seed, step, prompt_uid, sample_index)

    def eval_seed(self, prompt_uid: int, sample_index: int) -> int | None:
        """The evaluator's per-sample seed (apart from the training stream's), or None."""
        return stable_hash("eval-sample", prompt_uid, sample_index) if self.seeded_sampling else None

    def rank_split(self, groups: int, world: int) -> list[int] | None:
        """Which rank generates each of `groups` prompt groups (submission order) under torchrun. fixed routing:
        contiguous near-equal blocks in submission order (group i -> rank i * W // G), so a group's rank depends
        on nothing that runs; with per-sample seeds and batch-invariant ops its bits do not depend on the rank at
        all. dynamic: None, by availability (ranks claim chunks from a shared queue)."""
        if not self.fixed_routing:
            return None
        return [i * world // groups for i in range(groups)]

    def order(self, results: list[Result], requests: list[Request]) -> list[Result]:
        """submission: (data position, then sample index); completion: as the engine returned them."""
        if not self.submission_order:
            return list(results)
        rank = {r.uid: i for i, r in enumerate(requests)}
        return sorted(results, key=lambda r: rank[r.uid])


def setup(mode, seed: int) -> Determinism:
    """Seed every RNG from the run seed (CUDA's too: torch.manual_seed seeds every device) and set torch's
    global determinism flags, before any CUDA work (cuBLAS reads its workspace config at first use).
    `mode`: True / False (the on / off presets), a preset name, or a DeterminismConfig."""
    sources = _sources(mode)
    check(sources)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    pinned = sources["torch_algorithms"] == SOURCES["torch_algorithms"][0]
    if pinned:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(pinned)
    # ...but without NaN-filling every torch.empty (a guard for kernels that read memory they never wrote:
    # none here, and the bitwise tests would see it): measured ~20% of a CPU decode step on the tiny model
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = pinned
    torch.backends.cudnn.benchmark = not pinned
    torch.backends.cuda.matmul.allow_tf32 = not pinned
    torch.backends.cudnn.allow_tf32 = not pinned
    return Determinism(sources=sources, seed=seed)
