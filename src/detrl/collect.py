"""The rollout half of a step: requests -> engine -> rewards -> whole prompt groups -> training tensors.

`collect` generates fresh groups each step; `collect_partial` keeps unfinished groups in a
`PartialBuffer` across steps. Both take groups in the order `determinism` gives (submission order when
on, completion order when off) and apply DAPO's dynamic sampling and overlong shaping when configured.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from detrl.algos import filter_groups, overlong_penalty
from detrl.rollout import Request, Result
from detrl.rollout.partial import Group, PartialBuffer, Sample

if TYPE_CHECKING:  # annotations only: the config's validation imports this module
    from detrl.config import TrainConfig

PARTIAL_KEYS = (
    "partial/carried",
    "partial/restarted",
    "partial/staleness_mean",
    "partial/staleness_max",
    "partial/buffer_groups",
    "response/aborted_ratio",
)


@dataclass
class StepBatch:
    """One step's training data, in training order. N sequences, L = ctx_len."""

    results: list[Result]  # full responses
    scores: torch.Tensor  # [N] reward used for advantages (incl. shaping)
    correct: torch.Tensor  # [N] task reward before shaping
    group_ids: torch.Tensor  # [N] index of the prompt group
    input_ids: torch.Tensor  # [N, L] prompt + response, left-aligned, zero-padded
    mask: torch.Tensor  # [N, L-1] 1.0 where the next token is a response token
    rollout_logp: torch.Tensor  # [N, L-1] the engine's logprob of that token
    versions: torch.Tensor  # [N, L-1] policy version that sampled that token (-1 off the response)
    # MoE engines that record: [N, L-1, layers, k] int16, at position j the experts the engine routed token j to
    # in the pass that sampled token j+1 (a response token), -1 off the response; None otherwise
    routed_experts: torch.Tensor | None = None
    gen_rounds: int = 1
    kept_groups: int = 0
    stats: dict[str, float] = field(default_factory=dict)  # partial-rollout metrics


@dataclass
class Scored:
    results: list[Result]
    shaped: torch.Tensor  # [n]
    correct: torch.Tensor  # [n]
    versions: list[list[int]] | None = None


class GroupSource:
    """Makes requests for new prompt groups from the task, advancing the data position."""

    def __init__(self, det, task, tokenizer, cfg: TrainConfig):
        self.det, self.task, self.tokenizer, self.cfg = det, task, tokenizer, cfg

    def new(self, step: int, data_pos: int, count: int) -> list[tuple[int, str, list[Request]]]:
        out = []
        for i, p in enumerate(self.task.batch(data_pos, count)):
            uid = self.det.prompt_uid(data_pos + i)
            ids = tuple(self.task.encode(self.tokenizer, p))  # the chat template applied when configured
            reqs = [
                Request(uid, k, ids, self.det.sampling_seed(step, uid, k)) for k in range(self.cfg.rollout.n)
            ]
            out.append((uid, p.answer, reqs))
        return out

    def score(self, results: list[Result], answer: str, task=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(shaped, correct) rewards of a group's responses; `task` (default the train split) counts the errors."""
        ol = self.cfg.algo.overlong
        # the response without its stop token (eos / <|im_end|> ...); a reward that raises or times out scores 0
        texts = self.tokenizer.batch_decode(
            [r.tokens[:-1] if r.finish_reason == "stop" else r.tokens for r in results],
            skip_special_tokens=True,
        )
        correct = torch.tensor((task or self.task).score_texts(texts, answer))
        shaped = correct.clone()
        if ol.enabled:
            lengths = torch.tensor([len(r.tokens) for r in results])
            shaped = shaped + overlong_penalty(
                lengths, self.cfg.rollout.max_new_tokens, ol.buffer_len, ol.penalty_factor
            )
        return shaped, correct

    def keep(self, groups: list[Scored]) -> list[Scored]:
        """DAPO dynamic sampling: drop groups whose `algo.filter_groups.metric` is all equal (when enabled)."""
        fg = self.cfg.algo.filter_groups
        if not fg.enabled:
            return groups
        uids = [g.results[0].request.prompt_uid for g in groups]
        flat_m = [x for g in groups for x in filter_metric(g, fg.metric).tolist()]
        flat_u = [u for g, u in zip(groups, uids) for _ in g.results]
        kept = set(filter_groups(flat_m, flat_u))
        return [g for g, u in zip(groups, uids) if u in kept]

    def check_rounds(self, rounds: int, kept: int, step: int) -> None:
        fg = self.cfg.algo.filter_groups
        if fg.enabled and fg.max_num_gen_batches and rounds > fg.max_num_gen_batches:
            raise RuntimeError(
                f"dynamic sampling kept {kept} of {self.cfg.train_batch_size} groups after "
                f"algo.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} rounds at step {step}; "
                "raise it, or set it to 0 for no limit"
            )


FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")  # algo.filter_groups.metric


def filter_metric(group: Scored, metric: str) -> torch.Tensor:
    """The per-sample value dynamic sampling compares within a group (verl's filter_groups.metric).

    acc, score: the task reward before shaping (`correct`); seq_reward, seq_final_reward: the reward the
    advantages use (`shaped`, incl. overlong shaping; detrl puts no KL into the reward, so they agree)."""
    if metric in ("acc", "score"):
        return group.correct
    if metric in ("seq_reward", "seq_final_reward"):
        return group.shaped
    raise ValueError(
        f"algo.filter_groups.metric={metric!r} is not valid; choose one of {list(FILTER_METRICS)}"
    )


def collect(engine, source: GroupSource, step: int, data_pos: int, ctx_len: int) -> tuple[StepBatch, int]:
    """Fresh groups each step; with dynamic sampling, generate rounds until enough groups have signal."""
    cfg, det = source.cfg, source.det
    kept: list[Scored] = []
    rounds = 0
    per_round = cfg.algo.gen_batch_size or cfg.train_batch_size  # prompts per generation round (verl's)
    while len(kept) < cfg.train_batch_size:
        rounds += 1
        source.check_rounds(rounds, len(kept), step)
        fresh = source.new(step, data_pos, per_round)
        data_pos += per_round
        requests = [r for _, _, reqs in fresh for r in reqs]
        results = det.order(engine.generate(requests), requests)
        answers = {uid: ans for uid, ans, _ in fresh}
        by_group: dict[int, list[Result]] = {}  # first-seen order: submission (on) or completion (off)
        for r in results:
            by_group.setdefault(r.request.prompt_uid, []).append(r)
        scored = [Scored(rs, *source.score(rs, answers[uid])) for uid, rs in by_group.items()]
        kept += source.keep(scored)
    batch = to_tensors(kept[: cfg.train_batch_size], ctx_len, version=step - 1)
    batch.gen_rounds, batch.kept_groups = rounds, min(len(kept), cfg.train_batch_size)
    batch.stats = dict.fromkeys(PARTIAL_KEYS, 0.0)  # the same keys in every run
    return maybe_balance(batch, cfg), data_pos


def collect_partial(
    engine, source: GroupSource, buffer: PartialBuffer, step: int, data_pos: int, ctx_len: int
) -> tuple[StepBatch, int]:
    """Partial rollout: continue the buffer's unfinished samples and top it up with new groups; stop once
    `train_batch_size` groups are complete (on: at a token-budget round boundary; off: as the first
    groups finish); unfinished samples stay in the buffer for the next step."""
    cfg, det = source.cfg, source.det
    pr, need = cfg.rollout.partial, cfg.train_batch_size
    version = step - 1  # updates applied to the weights generating now
    restarted = buffer.restart_stale(version, pr.max_staleness)
    carried = buffer.carried()
    budget = token_budget(pr.token_budget, cfg.rollout.max_new_tokens)
    in_flight = math.ceil(need * pr.oversample)

    def top_up() -> None:
        nonlocal data_pos
        new = max(0, in_flight - len(buffer.groups))
        buffer.groups += [
            Group(uid, ans, [Sample(r) for r in reqs]) for uid, ans, reqs in source.new(step, data_pos, new)
        ]
        data_pos += new

    ready: list[tuple[Group, Scored]] = []
    rounds, calls, aborted = 1, 0, 0
    top_up()
    while True:
        pending = buffer.pending()
        samples = {s.request.uid: s for s in pending}
        if det.budget_cut:  # deterministic cut: every pending sample advances by at most token_budget tokens
            results = engine.generate([s.continuation(budget) for s in pending])
        else:  # async cut: when enough groups finish, or at a wall-clock budget, wherever the others are
            if pr.off_cut == "time":
                stop = _time_up(time.perf_counter() + pr.time_budget_s)
            else:
                stop = _groups_done(buffer, need - len(ready))
            results = engine.generate([s.continuation(None) for s in pending], stop_when=stop)
        calls += len(results)
        aborted += sum(r.finish_reason == "abort" for r in results)
        for r in results:
            samples[r.uid].absorb(r, version)
        complete = [g for g in buffer.groups if g.complete]  # submission order
        if not det.submission_order:  # completion order: by when each group's last sample came back
            last = {r.request.prompt_uid: i for i, r in enumerate(results)}
            complete.sort(key=lambda g: last.get(g.prompt_uid, -1))
        buffer.take(complete)
        scored = []
        for g in complete:
            rs = [s.as_result() for s in g.samples]
            scored.append(Scored(rs, *source.score(rs, g.answer), [s.versions for s in g.samples]))
        kept = {id(sc) for sc in source.keep(scored)}
        ready += [(g, sc) for g, sc in zip(complete, scored) if id(sc) in kept]
        if len(ready) >= need:
            break
        if not buffer.pending():  # all in flight done, too few kept: another round of prompts
            rounds += 1
            source.check_rounds(rounds, len(ready), step)
            top_up()
    buffer.groups[:0] = [g for g, _ in ready[need:]]  # complete but not needed now: first in line next step
    batch = to_tensors([sc for _, sc in ready[:need]], ctx_len, version)
    lag = version - batch.versions[batch.mask > 0]
    batch.gen_rounds, batch.kept_groups = rounds, need
    batch.stats = {
        "partial/carried": float(carried),
        "partial/restarted": float(restarted),
        "partial/staleness_mean": lag.float().mean().item(),
        "partial/staleness_max": float(lag.max().item()),
        "partial/buffer_groups": float(len(buffer.groups)),
        "response/aborted_ratio": aborted / max(calls, 1),
    }
    return maybe_balance(batch, cfg), data_pos


def balanced_order(tokens: list[int], per_mini: int, micro: int) -> list[int]:
    """verl's trainer.balance_batch for detrl's unit of parallelism: each mini-batch of `per_mini` rows is cut
    into micro-batches of `micro` rows (the last may be smaller) whose token counts are near equal (under
    torchrun, micro-batch k runs on rank k mod W), and laid out micro-batch after micro-batch. verl partitions by
    Karmarkar-Karp across DP ranks (ray_trainer.py `_balance_batch` @ 1dda039); this is the greedy
    longest-first rule (each row, longest first, to the open micro-batch with the fewest tokens), a function
    of the lengths alone (ties by index), so the same under every determinism setting.

    >>> balanced_order([9, 1, 8, 2], per_mini=4, micro=2)
    [0, 1, 2, 3]
    >>> balanced_order([9, 8, 1, 2], per_mini=4, micro=2)
    [0, 2, 1, 3]
    """
    order: list[int] = []
    for start in range(0, len(tokens), per_mini):
        rows = range(start, min(start + per_mini, len(tokens)))
        sizes = [min(micro, len(rows) - k) for k in range(0, len(rows), micro)]
        parts: list[list[int]] = [[] for _ in sizes]
        totals = [0] * len(sizes)
        for i in sorted(rows, key=lambda i: (-tokens[i], i)):
            j = min((p for p in range(len(parts)) if len(parts[p]) < sizes[p]), key=lambda p: (totals[p], p))
            parts[j].append(i)
            totals[j] += tokens[i]
        order += [i for p in parts for i in sorted(p)]
    return order


def maybe_balance(batch: StepBatch, cfg: TrainConfig) -> StepBatch:
    """`algo.balance_batch`: the batch reordered by `balanced_order`, with verl's global_seqlen/* spread metrics
    (max - min of the micro-batches' token counts, before and after); unchanged otherwise."""
    if not cfg.algo.balance_batch:
        return batch
    tokens = [len(r.request.prompt_ids) + len(r.tokens) for r in batch.results]
    per_mini = (cfg.algo.ppo_mini_batch_size or cfg.train_batch_size) * cfg.rollout.n
    order = balanced_order(tokens, per_mini, cfg.micro_batch_size)

    cuts = _micro_slices(len(order), per_mini, cfg.micro_batch_size)

    def spread(idx: list[int]) -> float:  # max - min of the micro-batches' token counts
        totals = [sum(tokens[i] for i in idx[lo:hi]) for lo, hi in cuts]
        return float(max(totals) - min(totals))

    idx = torch.tensor(order)
    out = dataclasses.replace(
        batch,
        results=[batch.results[i] for i in order],
        **{
            k: getattr(batch, k)[idx]
            for k in ("scores", "correct", "group_ids", "input_ids", "mask", "rollout_logp", "versions")
        },
        routed_experts=None if batch.routed_experts is None else batch.routed_experts[idx],
    )
    before = spread(list(range(len(order))))
    out.stats = {
        **batch.stats,
        "global_seqlen/minmax_diff": before,
        "global_seqlen/balanced_minmax_diff": spread(order),
    }
    return out


def _micro_slices(n: int, per_mini: int, micro: int) -> list[tuple[int, int]]:
    """(start, stop) of every micro-batch: `micro` rows at a time within each mini-batch of `per_mini`."""
    return [
        (lo, min(lo + micro, start + per_mini, n))
        for start in range(0, n, per_mini)
        for lo in range(start, min(start + per_mini, n), micro)
    ]


ROUNDS_PER_RESPONSE = 4  # token_budget=0 (auto): a response takes at most this many rounds


def token_budget(configured: int, max_new_tokens: int) -> int:
    """New tokens per pending sample per round of the deterministic cut. Every round re-prefills prompt + prefix,
    so the budget bounds the rounds a response can take (1 token a round: O(length^2) prefill work).

    >>> token_budget(0, 4), token_budget(0, 1024), token_budget(16, 1024)
    (1, 256, 16)
    """
    return configured or -(-max_new_tokens // ROUNDS_PER_RESPONSE)


def _time_up(deadline: float):
    """stop_when for the wall-clock cut."""
    return lambda done: time.perf_counter() >= deadline


def _groups_done(buffer: PartialBuffer, need: int):
    """stop_when for the async cut: true once `need` more groups of the buffer are complete."""
    groups = {g.prompt_uid: g for g in buffer.groups}

    def stop(done: list[Result]) -> bool:
        finished: dict[int, int] = {}
        for r in done:
            if r.finish_reason != "abort":
                finished[r.request.prompt_uid] = finished.get(r.request.prompt_uid, 0) + 1
        n_complete = 0
        for uid, g in groups.items():
            if g.complete:
                continue
            waiting = sum(1 for s in g.samples if s.finish is None)
            n_complete += finished.get(uid, 0) >= waiting
        return n_complete >= need

    return stop


def _placed(values, start: int, fill, length: int) -> list:
    """A row of `length` entries: `values` from index `start`, `fill` elsewhere."""
    return [*[fill] * start, *values, *[fill] * (length - start - len(values))]


def to_tensors(groups: list[Scored], ctx_len: int, version: int) -> StepBatch:
    results = [r for g in groups for r in g.results]
    group_ids = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.results])
    token_versions = [
        v for g in groups for v in (g.versions or [[version] * len(r.tokens) for r in g.results])
    ]
    n, scored = len(results), ctx_len - 1  # scored: the positions that score a next token
    ids, mask, logp, vers = [], [], [], []  # rows as lists, one tensor per field (not 4 per row)
    for r, v in zip(results, token_versions):
        p, t = len(r.request.prompt_ids), len(r.tokens)
        ids.append(_placed([*r.request.prompt_ids, *r.tokens], 0, 0, ctx_len))
        mask.append(_placed([1.0] * t, p - 1, 0.0, scored))  # position p - 1 scores the first response token
        logp.append(_placed(r.logprobs, p - 1, 0.0, scored))
        vers.append(_placed(v, p - 1, -1, scored))
    input_ids = torch.tensor(ids, dtype=torch.long).view(n, ctx_len)  # view: n = 0 keeps its shape
    mask = torch.tensor(mask).view(n, scored)
    rollout_logp = torch.tensor(logp).view(n, scored)
    versions = torch.tensor(vers, dtype=torch.long).view(n, scored)
    scores = torch.cat([g.shaped for g in groups])
    correct = torch.cat([g.correct for g in groups])
    return StepBatch(
        results,
        scores,
        correct,
        group_ids,
        input_ids,
        mask,
        rollout_logp,
        versions,
        routed_experts(results, ctx_len),
    )


def routed_experts(results: list[Result], ctx_len: int) -> torch.Tensor | None:
    """The responses' recorded routing laid out as the mask: [N, L-1, layers, k] int16, -1 off the response
    (None unless every result carries it)."""
    if not results or any(r.routed_experts is None for r in results):
        return None
    out = torch.full((len(results), ctx_len - 1, *results[0].routed_experts.shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(results):
        if len(r.routed_experts) != len(r.tokens):
            raise ValueError(
                f"sample {r.uid}: {len(r.routed_experts)} routed-expert rows for {len(r.tokens)} tokens"
            )
        p = len(r.request.prompt_ids)
        out[i, p - 1 : p - 1 + len(r.tokens)] = torch.from_numpy(r.routed_experts)
    return out
