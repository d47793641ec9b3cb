"""Synthetic verifiable arithmetic, generated deterministically from a seed (e.g. `17+25=` -> `42`)."""

from __future__ import annotations

import random

from detrl.data.base import Problem, Task

__all__ = ["ArithmeticTask", "Problem", "exact_match_reward"]


def _solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response (up to the end-of-sequence token) is exactly the answer, else 0.0."""
    return 1.0 if response.strip() == answer else 0.0


class ArithmeticTask(Task):
    """All problems `a op b` over the operand range, in a seeded order, as a `datasets.Dataset`.

    >>> task = ArithmeticTask(min_operand=0, max_operand=2, ops=["+"], seed=0)
    >>> len(task), task[0].prompt.endswith("=")
    (9, True)
    """

    name = "arithmetic"

    def __init__(self, min_operand: int, max_operand: int, ops: list[str], seed: int):
        rows = [
            {"prompt": f"{a}{op}{b}=", "answer": str(_solve(a, op, b))}
            for op in ops
            for a in range(min_operand, max_operand + 1)
            for b in range(min_operand, max_operand + 1)
        ]
        random.Random(seed).shuffle(rows)
        # plain lists: indexing a Dataset per item is slow
        super().__init__([r["prompt"] for r in rows], [r["answer"] for r in rows])

    @property
    def dataset(self):
        """The problems as a `datasets.Dataset` (columns prompt, answer), made when asked: a training run never
        reads it, and importing datasets (with pandas and pyarrow) costs each process ~85 MiB of RSS."""
        from datasets import Dataset

        return Dataset.from_dict({"prompt": list(self._prompts), "answer": list(self._answers)})

    def subset(self, indices: list[int]) -> Task:
        """The rows at `indices` (in that order) as a task of their own (a train or held-out split)."""
        out = Task.__new__(type(self))
        Task.__init__(out, [self._prompts[i] for i in indices], [self._answers[i] for i in indices])
        return out

    def encode(self, tokenizer, problem: Problem) -> list[int]:
        """bos (when the tokenizer has one) + the characters: what the warm start trained on."""
        ids = tokenizer(problem.prompt, add_special_tokens=False)["input_ids"]
        return [tokenizer.bos_token_id, *ids] if tokenizer.bos_token_id is not None else list(ids)

    def encode_all(self, tokenizer) -> list[tuple[int, ...]]:
        return [tuple(self.encode(tokenizer, self[i])) for i in range(len(self))]

    def reward(self, response: str, answer: str) -> float:
        return exact_match_reward(response, answer)
