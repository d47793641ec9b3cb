"""Compare runs step by step through their fingerprints (metrics.jsonl rows)."""

from __future__ import annotations

import json
from pathlib import Path

# in the order a step produces them: where a divergence shows first says where it entered
FP_ORDER = ("fp/rollout_tokens", "fp/rollout_logprobs", "fp/batch_order", "fp/params")


def load_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's metrics.jsonl; a half-written last line (a killed run) is dropped."""
    rows = []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def trajectory(rows: list[dict]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(r[k] for k in FP_ORDER) for r in rows)


def first_divergence(a: list[dict], b: list[dict]) -> tuple[int, str] | None:
    """(step, fingerprint key) of the first difference between two runs, or None if they agree.

    >>> first_divergence([{"step": 1, **dict.fromkeys(FP_ORDER, "x")}], [{"step": 1, **dict.fromkeys(FP_ORDER, "x")}])
    """
    for ra, rb in zip(a, b):
        for key in FP_ORDER:
            if ra[key] != rb[key]:
                return ra["step"], key
    return None


def distinct_trajectories(runs: list[list[dict]]) -> int:
    return len({trajectory(r) for r in runs})
