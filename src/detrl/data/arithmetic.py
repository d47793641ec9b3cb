"""Synthetic verifiable arithmetic, generated deterministically from a seed (e.g. `17+25=` -> `42`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset


@dataclass(frozen=True)
class Problem:
    index: int  # position in the dataset: part of the prompt uid
    prompt: str  # "17+25="
    answer: str  # "42"


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


class ArithmeticTask:
    """All problems `a op b` over the operand range, in a seeded order, as a `datasets.Dataset`.

    >>> task = ArithmeticTask(min_operand=0, max_operand=2, ops=["+"], seed=0)
    >>> len(task), task[0].prompt.endswith("=")
    (9, True)
    """

    def __init__(self, min_operand: int, max_operand: int, ops: list[str], seed: int):
        rows = [
            {"prompt": f"{a}{op}{b}=", "answer": str(_solve(a, op, b))}
            for op in ops
            for a in range(min_operand, max_operand + 1)
            for b in range(min_operand, max_operand + 1)
        ]
        random.Random(seed).shuffle(rows)
        self.dataset = Dataset.from_list(rows)
        self._prompts = list(self.dataset["prompt"])  # plain lists: indexing a Dataset per item is slow
        self._answers = list(self.dataset["answer"])

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Problem:
        return Problem(index, self._prompts[index], self._answers[index])

    def batch(self, position: int, size: int) -> list[Problem]:
        """`size` problems starting at data position `position`, wrapping around the dataset."""
        return [self[(position + i) % len(self)] for i in range(size)]


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response (up to the end-of-sequence token) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer else 0.0
