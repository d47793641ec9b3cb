"""The data group (`conf/data/*.yaml`): the task, its files and rewards; and the eval settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from detrl.config.base import check, choice

ARITHMETIC_OPS = ("+", "-", "*")
GSM8K_METHODS = ("strict", "flexible")
NON_NEGATIVE = {  # data.<key>: the rule its error names
    "max_prompt_length": "must be >= 0 (0 = keep all)",
    "reward_timeout_s": "must be >= 0 (0 = no limit)",
    "reward_workers": "must be >= 0 (0 = score in the trainer)",
}


@dataclass
class DataConfig:
    name: str = "arithmetic"  # arithmetic | gsm8k | math (src/detrl/data/registry.py)
    # arithmetic only
    min_operand: int = 0
    max_operand: int = 9
    ops: list[str] = field(default_factory=lambda: ["+"])
    # held-out share of the rows for evaluation when data.eval_path is not given (chosen by the seed)
    eval_fraction: float = 0.0
    # gsm8k / math: local files read through `datasets` (a .parquet / .jsonl / .json file, or a dir of them)
    path: str | None = None
    eval_path: str | None = None
    prompt_key: str | None = (
        None  # column of the prompt (a dotted path reaches into a struct); None: the task's default
    )
    answer_key: str | None = None  # column of the gold answer; None: the task's default
    prompt_template: str | None = None  # "{prompt}" stands for the row's prompt; None: the task's default
    chat_template: bool = False  # render prompts with the tokenizer's chat template
    enable_thinking: bool | None = (
        None  # passed to the chat template (Qwen3's thinking switch); None: not passed
    )
    system_prompt: str | None = None
    max_prompt_length: int = 0  # prompts longer than this many tokens are left out (0 = keep all)
    shuffle: bool = True  # file tasks: the training order is a seeded shuffle of the rows
    gsm8k_method: str = "flexible"  # strict (only "#### N") | flexible (then \\boxed{}, then the last number)
    reward_timeout_s: float = 5.0  # a sample's reward running longer scores 0 and counts in reward/errors
    reward_workers: int = 0  # gsm8k / math: processes scoring each group's responses (0: the trainer's own)

    def validate(self) -> None:
        from detrl.data.registry import TASK_NAMES

        choice("data.name", self.name, TASK_NAMES)
        if self.name != "arithmetic":
            check(
                self.path is not None,
                "data.path",
                self.path,
                f"data={self.name} reads local files: set data.path=/file/or/dir",
            )
        check(0 <= self.eval_fraction < 1, "data.eval_fraction", self.eval_fraction, "must be in [0, 1)")
        choice("data.gsm8k_method", self.gsm8k_method, GSM8K_METHODS)
        for key, rule in NON_NEGATIVE.items():
            check(getattr(self, key) >= 0, f"data.{key}", getattr(self, key), rule)
        check(
            set(self.ops) <= set(ARITHMETIC_OPS) and len(self.ops) > 0,
            "data.ops",
            list(self.ops),
            f"choose a non-empty subset of {list(ARITHMETIC_OPS)}",
        )
        check(
            0 <= self.min_operand <= self.max_operand,
            "data.max_operand",
            self.max_operand,
            f"must be >= data.min_operand={self.min_operand} >= 0",
        )


@dataclass
class EvalConfig:
    every: int = 0  # evaluate on the eval split every N steps (and at the last step); 0 = never
    n: int = 1  # samples per eval prompt
    greedy: bool = True  # greedy decoding; false: sample with eval.temperature / eval.top_p
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompts: int = 0  # evaluate on the first N prompts of the eval split (0 = all)
    batch_prompts: int = 64  # prompts per engine call (the progress bar advances per call)

    def validate(self) -> None:
        check(self.every >= 0, "eval.every", self.every, "must be >= 0 (0 = never)")
        check(self.n >= 1, "eval.n", self.n, "must be >= 1")
        check(self.temperature > 0, "eval.temperature", self.temperature, "must be > 0")
        check(0 < self.top_p <= 1, "eval.top_p", self.top_p, "must be in (0, 1]")
        check(self.max_prompts >= 0, "eval.max_prompts", self.max_prompts, "must be >= 0 (0 = all)")
        check(self.batch_prompts >= 1, "eval.batch_prompts", self.batch_prompts, "must be >= 1")
