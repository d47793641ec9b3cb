"""Under torchrun: each rank's own rollout engine behind the engine interface, sharing every `generate`."""

from __future__ import annotations

import itertools
import time

from detrl.rollout.base import Request, Result

_RANK_ENGINES = itertools.count()  # every rank makes its engines in the same order


class RankEngine:
    """Under torchrun: this rank's own engine behind the engine interface, sharing each `generate` with the
    other ranks. Its prompt groups are split across ranks (on: `det.rank_split`, a fixed rule in submission
    order; off: by availability, ranks claim chunks of groups from a shared counter in the job's store until
    none is left, so a faster rank takes more). Every rank gets every result back: on in submission order,
    off in completion order across ranks (by the wall clock at which each rank's chunk came back). All ranks
    call `generate` with the same requests (the data position and the scoring are replicated)."""

    def __init__(self, engine, det):
        from detrl import distributed

        self.engine, self.det, self.dist = engine, det, distributed
        self.world, self.rank = distributed.world_size(), distributed.rank()
        self._prefix, self._call = (
            f"detrl/rollout/{next(_RANK_ENGINES)}",
            0,
        )  # store keys: unique per engine, call
        if self.rank:  # off: each rank's engine its own stream (unseeded requests), as separate replicas
            engine.generator.manual_seed(det.seed + self.rank)

    def __getattr__(self, name):  # update_weights, close, generator, batch_log ...: the local engine's
        return getattr(self.engine, name)

    @property
    def params(self):
        return self.engine.params

    @params.setter
    def params(self, value):
        self.engine.params = value

    def generate(self, requests: list[Request], params=None, stop_when=None) -> list[Result]:
        if stop_when is not None:
            raise ValueError("a cut (stop_when) is single-process only")
        self._call += 1
        groups: list[list[int]] = []  # request indices per prompt group, in submission order
        for i, r in enumerate(requests):
            if not groups or requests[groups[-1][0]].prompt_uid != r.prompt_uid:
                groups.append([])
            groups[-1].append(i)
        owners = self.det.rank_split(len(groups), self.world)
        done: list[tuple[float, int, int, tuple]] = []  # (time, rank, position, (index, Result fields...))
        if owners is not None:
            mine = [i for g, o in zip(groups, owners) if o == self.rank for i in g]
            if mine:
                self._run(requests, mine, done, params)
        else:
            size = max(1, -(-len(groups) // (2 * self.world)))  # about two claims per rank
            counter = f"{self._prefix}/{self._call}"
            while (c := self.dist.store().add(counter, 1) - 1) * size < len(
                groups
            ):  # claim, generate, repeat
                self._run(requests, [i for g in groups[c * size : (c + 1) * size] for i in g], done, params)
        gathered = sorted(x for part in self.dist.all_gather_object(done) for x in part)
        if owners is not None:  # submission order
            gathered.sort(key=lambda x: x[3][0])
        return [Result(requests[i], *out) for *_, (i, *out) in gathered]

    def _run(self, requests, idx: list[int], done: list, params) -> None:
        results = self.engine.generate([requests[i] for i in idx], params)
        t = time.time()
        pos = {id(requests[i]): i for i in idx}
        done += [
            (
                t,
                self.rank,
                len(done) + j,
                (pos[id(r.request)], r.tokens, r.logprobs, r.finish_reason, r.routed_experts),
            )
            for j, r in enumerate(results)
        ]
