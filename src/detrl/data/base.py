"""What every task gives the trainer: problems by data position, prompt token ids, and a safe reward.

A task is a list of (prompt, answer) rows. `prompt` is a string or a list of chat messages; `encode` turns a
problem into prompt token ids (the tokenizer's chat template when `data.chat_template=true`), `score` turns
decoded responses into rewards: a reward function that raises, or runs past `data.reward_timeout_s`, scores 0
and is counted in `errors` (logged as `reward/errors`), so one odd sample never stops a run. With a timeout (or
`data.reward_workers` > 0) a group's responses are scored in worker processes (`max(1, reward_workers)`, spawned
once, each holding a copy of the task) that are killed at the deadline (`detrl.data.scoring`); a score is a
function of the text alone, so the pool changes no bits.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrl.config.base import ConfigError

SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}


class DataError(ConfigError):
    """A missing or malformed data file or column; the message is one line naming it."""


@dataclass(frozen=True)
class Problem:
    index: int  # position in the dataset: part of the prompt uid
    prompt: Any  # "17+25=" (arithmetic), a question string, or a list of chat messages
    answer: str  # the gold answer the reward compares with


class Task:
    """Rows of (prompt, answer) in a fixed order; `batch(position, size)` wraps around."""

    name = "task"
    reward_timeout_s = 0.0  # 0: no limit
    reward_workers = 0  # processes scoring a group's responses (0: this one)

    def __init__(self, prompts: Sequence[Any], answers: Sequence[str]):
        self._prompts, self._answers = list(prompts), [str(a) for a in answers]
        self._ids: list[tuple[int, ...]] | None = None  # encoded prompts, filled by `encode_all`
        self.errors = 0  # reward calls that raised or timed out since the last `pop_errors`
        self.eval_task: Task | None = None  # the held-out split (set by the registry)
        self._scorer = None  # a `detrl.data.scoring.ScoringPool`, made at first use

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Problem:
        return Problem(index, self._prompts[index], self._answers[index])

    def batch(self, position: int, size: int) -> list[Problem]:
        """`size` problems starting at data position `position`, wrapping around the dataset."""
        return [self[(position + i) % len(self)] for i in range(size)]

    # --- prompts
    def render(self, tokenizer, problem: Problem) -> str:
        return (
            problem.prompt
            if isinstance(problem.prompt, str)
            else "\n".join(m["content"] for m in problem.prompt)
        )

    def encode(self, tokenizer, problem: Problem) -> list[int]:
        if self._ids is not None:
            return list(self._ids[problem.index])
        return self._encode_texts(tokenizer, [self.render(tokenizer, problem)])[0]

    def encode_all(self, tokenizer) -> list[tuple[int, ...]]:
        """Every prompt's ids, computed once (a batch call of the fast tokenizer) and kept."""
        if self._ids is None:
            texts = [self.render(tokenizer, self[i]) for i in range(len(self))]
            self._ids = [tuple(x) for x in self._encode_texts(tokenizer, texts)]
        return self._ids

    @staticmethod
    def _encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        bos = tokenizer.bos_token_id
        return [[bos, *x] if bos is not None else list(x) for x in ids]

    # --- rewards
    def reward(self, response: str, answer: str) -> float:
        raise NotImplementedError

    def prepare(self) -> None:
        """Called once in each scoring process before its first sample (imports, caches): none by default."""

    def score_unbounded(self, text: str, answer: str) -> tuple[float, bool]:
        """(reward, failed): a reward that raises scores 0 and says so (no time limit: see `score_texts`)."""
        try:
            return float(self.reward(text, answer)), False
        except Exception:  # noqa: BLE001 - any failure of one sample's reward scores 0 and is counted
            return 0.0, True

    def score_texts(self, responses: list[str], answer: str) -> list[float]:
        """Rewards of a group's responses. With a timeout or `reward_workers`, scored in worker processes killed
        at the deadline (a timeout cannot be caught there); without either, in this process."""
        if self.reward_workers > 0 or self.reward_timeout_s > 0:
            scored = self._pool().score(responses, answer)
        else:
            scored = [self.score_unbounded(text, answer) for text in responses]
        self.errors += sum(failed for _, failed in scored)
        return [score for score, _ in scored]

    def _pool(self):
        """The scoring processes (`reward_workers`, at least one), made at first use, closed with the task."""
        if self._scorer is None:  # the task goes pickled (the pool holds no reference to it)
            from detrl.data.scoring import ScoringPool

            self._scorer = ScoringPool(self, max(1, self.reward_workers), self.reward_timeout_s)
            weakref.finalize(self, self._scorer.close)
        return self._scorer

    def close(self) -> None:
        """Stop the scoring processes, if any (they are idle between groups). The task still scores afterwards,
        with a new pool."""
        if self._scorer is not None:
            self._scorer.close()
            self._scorer = None
        if self.eval_task is not None and self.eval_task is not self:
            self.eval_task.close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_scorer": None}  # a worker's copy scores in-process

    def pop_errors(self) -> int:
        n, self.errors = self.errors, 0
        return n


class ChatTask(Task):
    """A task read from files whose prompts go through the tokenizer's chat template when asked."""

    def __init__(
        self,
        prompts,
        answers,
        chat_template: bool = False,
        enable_thinking: bool | None = None,
        system_prompt: str | None = None,
        reward_timeout_s: float = 5.0,
        reward_workers: int = 0,
    ):
        super().__init__(prompts, answers)
        self.chat_template, self.enable_thinking, self.system_prompt = (
            chat_template,
            enable_thinking,
            system_prompt,
        )
        self.reward_timeout_s, self.reward_workers = reward_timeout_s, reward_workers

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        msgs = (
            [{"role": "user", "content": problem.prompt}]
            if isinstance(problem.prompt, str)
            else list(problem.prompt)
        )
        if self.system_prompt and not any(m["role"] == "system" for m in msgs):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def render(self, tokenizer, problem: Problem) -> str:
        if not self.chat_template:
            return super().render(tokenizer, problem)
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.chat_template=true but the tokenizer has no chat template (set data.chat_template=false)"
            )
        kwargs = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        return tokenizer.apply_chat_template(
            self.messages(problem), tokenize=False, add_generation_prompt=True, **kwargs
        )


# --- reading files


def data_files(path: str, key: str = "data.path") -> list[Path]:
    """The parquet / jsonl / json files at `path` (a file, or a dir of them); one line naming what is wrong."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{key}={path!r}: no such file or directory")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise DataError(f"{key}={path!r}: no .parquet, .jsonl or .json files in this directory")
    bad = [f for f in files if f.suffix not in SUFFIXES]
    if bad:
        raise DataError(f"{key}={path!r}: {bad[0].name} is not .parquet, .jsonl or .json")
    if len({SUFFIXES[f.suffix] for f in files}) > 1:
        raise DataError(f"{key}={path!r}: mixes parquet and json files; keep one format per split")
    return files


def load_rows(path: str, key: str = "data.path"):
    """A `datasets.Dataset` of every row of the files at `path` (read through `datasets`, offline)."""
    import datasets

    from detrl.warmstart import cache_root

    files = data_files(path, key)
    builder = SUFFIXES[files[0].suffix]
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(
            builder,
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=str(cache_root() / "datasets"),
        )
    except Exception as e:  # noqa: BLE001 - pyarrow / json errors come in many types
        # name the file that does not parse
        for f in files:
            try:
                datasets.load_dataset(
                    builder, data_files=[str(f)], split="train", cache_dir=str(cache_root() / "datasets")
                )
            except Exception as inner:  # noqa: BLE001
                raise DataError(f"{key}: cannot read {f}: {_one_line(inner)}") from None
        raise DataError(f"{key}={path!r}: cannot read the files: {_one_line(e)}") from None
    if len(ds) == 0:
        raise DataError(f"{key}={path!r}: no rows")
    return ds


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def column(ds, name: str, key: str, path: str) -> list[Any]:
    """The values of column `name` (a dotted path reaches into struct columns, e.g. reward_model.ground_truth)."""
    head, *rest = name.split(".")
    if head not in ds.column_names:
        raise DataError(f"{key}={name!r}: no such column in {path!r} (columns: {sorted(ds.column_names)})")
    try:
        values = list(ds[head])  # a lazy column in recent datasets: decode here
    except UnicodeDecodeError as e:  # the file's bytes are not UTF-8: name the first row that fails
        row = next((i for i in range(len(ds)) if not _decodes(ds, i, head)), "?")
        raise DataError(
            f"{key}={name!r}: row {row} of {path!r} is not UTF-8 text ({e.reason} at byte {e.start}); "
            "re-encode the file as UTF-8"
        ) from None
    for part in rest:
        try:
            values = [v[part] for v in values]
        except (KeyError, TypeError):
            raise DataError(f"{key}={name!r}: column {head!r} in {path!r} has no field {part!r}") from None
    return values


def _decodes(ds, i: int, head: str) -> bool:
    try:
        ds[i][head]
        return True
    except UnicodeDecodeError:
        return False


def split_eval(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices): `fraction` of the rows, chosen by the seed."""
    k = round(n * fraction)
    if fraction > 0 and k == 0:
        k = 1
    if k >= n:
        raise DataError(f"data.eval_fraction={fraction} holds out all {n} rows; lower it")
    held = set(random.Random(f"eval-split-{seed}").sample(range(n), k))
    return [i for i in range(n) if i not in held], sorted(held)
