"""Evaluation on the held-out split every `eval.every` steps, through the rollout engine, logged as `eval/*`.

Greedy by default (the nucleus of the single most likely token, i.e. argmax with ties to the lowest id), or
`eval.n` samples per prompt at `eval.temperature` / `eval.top_p`. With `determinism=on` each eval sample's
seed is a hash of (seed, eval row, sample index): the same at every eval and independent of batching, so
eval results are bitwise reproducible and evaluating never changes the training trajectory. With `off`
sampled evals draw from the engine's shared stream (as real systems do).

Every step also logs `reward/errors` (training rewards that raised or timed out; 0 otherwise). When eval is
on, every line carries the same `eval/*` keys: NaN on steps without an eval.
"""

from __future__ import annotations

import dataclasses
import math

from tqdm import tqdm

from detrl import distributed
from detrl.config import ConfigError, TrainConfig
from detrl.determinism import stable_hash
from detrl.rollout import Request

GREEDY_TOP_P = 1e-9  # top-p this small keeps only the most likely token: greedy decoding
EVAL_KEYS = (
    "eval/accuracy",
    "eval/pass_at_n",
    "eval/response_length/mean",
    "eval/clip_ratio",
    "eval/reward_errors",
    "eval/num_prompts",
)


class Evaluator:
    def __init__(self, cfg: TrainConfig, source):
        self.cfg, self.source = cfg, source
        self.task = getattr(source.task, "eval_task", None) if cfg.eval.every else None
        if cfg.eval.every and (self.task is None or len(self.task) == 0):
            raise ConfigError(
                "eval.every is set but there is no eval split: set data.eval_path or data.eval_fraction"
            )

    def step(self, step: int, engine) -> dict[str, float]:
        """Metrics for this step: reward/errors always; eval/* when eval is on (NaN between evals)."""
        out = {"reward/errors": float(self.source.task.pop_errors())}
        every = self.cfg.eval.every
        if every:
            due = step % every == 0 or step == self.cfg.steps
            out.update(self.run(engine, step) if due else dict.fromkeys(EVAL_KEYS, math.nan))
        return out

    def run(self, engine, step: int) -> dict[str, float]:
        e, det, tok = self.cfg.eval, self.source.det, self.source.tokenizer
        count = min(len(self.task), e.max_prompts or len(self.task))
        problems = self.task.batch(0, count)
        params = dataclasses.replace(
            engine.params,
            temperature=1.0 if e.greedy else e.temperature,
            top_p=GREEDY_TOP_P if e.greedy else e.top_p,
        )
        scores, lengths, clipped, per_prompt = [], [], 0, []
        self.task.pop_errors()  # count this eval's reward errors only
        bar = tqdm(
            total=count,
            desc=f"eval@{step}",
            unit="prompt",
            leave=False,
            dynamic_ncols=True,
            disable=not distributed.is_main(),
        )  # one bar per run, not per rank
        for lo in range(0, count, e.batch_prompts):
            chunk = problems[lo : lo + e.batch_prompts]
            requests = []
            for p in chunk:
                uid = stable_hash("eval", self.cfg.seed, p.index) & ((1 << 62) - 1)
                ids = tuple(self.task.encode(tok, p))
                requests += [Request(uid, k, ids, det.eval_seed(uid, k)) for k in range(e.n)]
            results = det.order(engine.generate(requests, params), requests)
            by_uid = {r.uid: r for r in results}
            for p, i in zip(chunk, range(0, len(requests), e.n)):
                rs = [by_uid[req.uid] for req in requests[i : i + e.n]]
                s = self.source.score(rs, p.answer, self.task)[
                    1
                ].tolist()  # the task reward, errors counted here
                scores += s
                per_prompt.append(max(s))
                lengths += [len(r.tokens) for r in rs]
                clipped += sum(r.finish_reason == "length" for r in rs)
            bar.update(len(chunk))
        bar.close()
        return {
            "eval/accuracy": sum(scores) / len(scores),
            "eval/pass_at_n": sum(per_prompt) / len(per_prompt),
            "eval/response_length/mean": sum(lengths) / len(lengths),
            "eval/clip_ratio": clipped / len(lengths),
            "eval/reward_errors": float(self.task.pop_errors()),
            "eval/num_prompts": float(count),
        }
