from detrl.data.arithmetic import ArithmeticTask, exact_match_reward
from detrl.data.base import DataError, Problem, Task
from detrl.data.registry import TASK_NAMES, build_task, stop_token_ids, tokenizer_for
from detrl.data.tokenizer import build_tokenizer, load_tokenizer

__all__ = [
    "TASK_NAMES",
    "ArithmeticTask",
    "DataError",
    "Problem",
    "Task",
    "build_task",
    "build_tokenizer",
    "exact_match_reward",
    "load_tokenizer",
    "stop_token_ids",
    "tokenizer_for",
]
