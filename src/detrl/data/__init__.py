from detrl.data.arithmetic import ArithmeticTask, Problem, exact_match_reward
from detrl.data.tokenizer import build_tokenizer, load_tokenizer

__all__ = ["ArithmeticTask", "Problem", "build_tokenizer", "exact_match_reward", "load_tokenizer"]
