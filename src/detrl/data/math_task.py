"""MATH / DAPO-Math-17k style tasks: a prompt (string or chat messages) and a gold answer; reward by math-verify.

Columns (`data.prompt_key`, `data.answer_key`, dotted paths reach into struct columns): defaults try `prompt`
then `problem` for the prompt, and `answer`, `reward_model.ground_truth` (verl / DAPO-Math-17k), `solution`
(MATH: its last `\\boxed{}` is the gold) for the answer.

The reward is HuggingFace's `math-verify` (`parse` both sides, `verify(gold, answer)`: LaTeX and plain
expressions, sets, intervals, units, equivalent forms). Its own signal-based timeouts are off, and a SIGALRM
would not help: its parser catches every exception. The task's `reward_timeout_s` bounds each sample from outside
instead (a worker process killed at the deadline, `detrl.data.scoring`): a timeout or an exception scores 0 and is
counted.
"""

from __future__ import annotations

from detrl.data.base import ChatTask
from detrl.data.gsm8k import last_boxed

PROMPT_KEYS = ("prompt", "problem", "question")
ANSWER_KEYS = ("answer", "reward_model.ground_truth", "solution")


def gold_from(value: str, key: str) -> str:
    """MATH's `solution` column holds a worked solution: the gold is its last \\boxed{}."""
    if key.split(".")[-1] == "solution":
        boxed = last_boxed(value)
        return boxed if boxed is not None else value
    return value


def math_reward(response: str, gold: str) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # the gold is LaTeX without delimiters ("2\sqrt{2}", "\frac{1}{2}", "34"): read it as math first
    target = parse(
        gold if "$" in gold or "\\boxed" in gold else f"${gold}$",
        extraction_config=configs,
        parsing_timeout=None,
    )
    if not target:
        target = parse(gold, extraction_config=configs, parsing_timeout=None)
    if not target:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    pred = parse(response, extraction_config=configs, parsing_timeout=None)
    return 1.0 if pred and verify(target, pred, timeout_seconds=None) else 0.0


class MathTask(ChatTask):
    name = "math"

    def reward(self, response: str, answer: str) -> float:
        return math_reward(response, answer)

    def prepare(self) -> None:
        math_reward("$\\boxed{1}$", "1")  # math-verify's and sympy's imports, outside any deadline
