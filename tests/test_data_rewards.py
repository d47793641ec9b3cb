"""Reward extractors on tricky answers; a reward that raises or hangs scores 0 and is counted."""

import time

import pytest

from detrl.data.base import Task
from detrl.data.gsm8k import extract_answer, gold_answer, gsm8k_reward
from detrl.data.math_task import MathTask, gold_from, math_reward

# (response, gold, flexible reward, strict reward)
GSM8K_TABLE = [
    ("So the answer is 42.\n#### 42", "42", 1, 1),
    ("#### 1,234", "1234", 1, 1),
    ("The total is $1,234.", "1234", 1, 0),
    ("#### $18", "18", 1, 1),
    ("#### 18.00", "18", 1, 1),
    ("She pays $18.00 in all.", "18", 1, 0),
    ("The answer is 18 dollars", "18", 1, 0),
    ("It takes 5 hours.", "5", 1, 0),
    ("The answer is \\boxed{72}.", "72", 1, 0),
    ("\\boxed{\\$1,000}", "1000", 1, 0),
    ("\\boxed{18 \\text{ apples}}", "18", 1, 0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1, 0),
    ("\\boxed{-3}", "-3", 1, 0),
    ("The temperature dropped to -5 degrees.", "-5", 1, 0),
    ("#### -7", "-7", 1, 1),
    ("The result is \u22124", "-4", 1, 0),
    ("Half of it: 3/4", "0.75", 1, 0),
    ("#### 3/4", "0.75", 1, 1),
    ("The answer is 50%", "50", 1, 0),
    ("First 3 + 4 = 7, then 7 * 2 = 14.\n#### 14", "14", 1, 1),
    ("#### 12\nActually, I think it is 13.", "12", 1, 1),  # the #### answer wins over a later number
    ("First #### 5 then #### 6", "6", 1, 1),  # the last #### wins
    ("I computed 10, then 20, finally 30.", "30", 1, 0),  # flexible: the last number
    ("I computed 10, then 20, finally 30.", "20", 0, 0),
    ("No idea.", "3", 0, 0),
    ("", "3", 0, 0),
    ("#### ", "3", 0, 0),
    ("The answer is 0.5", "1/2", 1, 0),
    ("#### 7.", "7", 1, 1),
    ("The answer is 2,000,000.", "2000000", 1, 0),
    ("\\boxed{12} is wrong, the final answer is 13", "12", 1, 0),  # the last \boxed beats later loose numbers
    ("Answer: 3.5", "7/2", 1, 0),
    ("#### 42", "41", 0, 0),
    ("about 1e3", "1000", 0, 0),  # scientific notation is not read as 1000
]


@pytest.mark.parametrize("response,gold,flexible,strict", GSM8K_TABLE)
def test_gsm8k_reward_table(response, gold, flexible, strict):
    assert gsm8k_reward(response, gold, "flexible") == flexible, extract_answer(response, "flexible")
    assert gsm8k_reward(response, gold, "strict") == strict, extract_answer(response, "strict")


def test_gsm8k_gold_is_what_follows_the_hashes():
    assert gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 1,072") == "1072"
    assert gold_answer("72") == "72"


# (response, gold, reward)
MATH_TABLE = [
    ("The answer is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1),
    ("The answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1),
    ("$\\boxed{\\dfrac{2}{4}}$", "1/2", 1),
    ("So $x = \\boxed{3}$", "3", 1),
    ("$\\boxed{3}$", "4", 0),
    ("$\\boxed{\\sqrt{8}}$", "2\\sqrt{2}", 1),
    ("$\\boxed{(1, 2]}$", "(1,2]", 1),
    ("$\\boxed{x^2+2x+1}$", "(x+1)^2", 1),
    ("no answer here", "5", 0),
    ("$\\boxed{\\pi}$", "\\pi", 1),
]


@pytest.mark.parametrize("response,gold,reward", MATH_TABLE)
def test_math_verify_reward_table(response, gold, reward):
    assert math_reward(response, gold) == reward


def test_math_gold_from_a_solution_is_its_last_box():
    assert gold_from("so it is $\\boxed{\\frac{3}{4}}$.", "solution") == "\\frac{3}{4}"
    assert gold_from("34", "reward_model.ground_truth") == "34"


class _Flaky(Task):
    reward_timeout_s = 0.2

    def reward(self, response, answer):
        if response == "raise":
            raise RuntimeError("boom")
        if response == "hang":
            time.sleep(5)
        return 1.0 if response == answer else 0.0


def test_a_reward_that_raises_or_hangs_scores_zero_and_is_counted():
    task = _Flaky(["q"], ["a"])
    t0 = time.perf_counter()
    assert task.score_texts(["a", "raise", "hang", "b", "a"], "a") == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert time.perf_counter() - t0 < 2.0
    assert task.pop_errors() == 2 and task.pop_errors() == 0


def test_reward_workers_score_the_same_and_count_failures_from_the_pool():
    """data.reward_workers: the group is scored in spawned processes, each sample under its own timeout; the
    scores and the error count are the in-process ones."""
    task = _Flaky(["q"], ["a"])
    task.reward_workers = 2
    texts = ["a", "raise", "hang", "b", "a", "hang"]
    try:
        assert task.score_texts(texts, "a") == [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        assert task.pop_errors() == 3
        assert task._executor is not None and len(task._executor._processes) == 2  # really in the pool
    finally:
        task._executor.shutdown(cancel_futures=True)
    rows = MathTask(["q"], ["\\frac{1}{2}"], reward_workers=2)
    responses = ["$\\boxed{0.5}$", "$\\boxed{\\frac{2}{4}}$", "$\\boxed{3}$", "no answer"]
    try:
        assert rows.score_texts(responses, "\\frac{1}{2}") == [
            math_reward(r, "\\frac{1}{2}") for r in responses
        ]
    finally:
        rows._executor.shutdown(cancel_futures=True)


def test_the_reward_pool_is_closed_with_the_task_and_survives_a_dead_worker():
    """close() stops the processes; a scoring process that dies makes that group score in-process (the same
    scores) and the next group gets a new pool, instead of stopping the run."""
    task = _Flaky(["q"], ["a"])
    task.reward_workers = 2
    assert task.score_texts(["a", "b"], "a") == [1.0, 0.0]
    procs = list(task._executor._processes.values())
    procs[0].kill()
    procs[0].join()
    assert task.score_texts(["a", "b", "a"], "a") == [1.0, 0.0, 1.0]
    assert task.score_texts(["b", "a"], "a") == [0.0, 1.0] and task._executor is not None
    procs = list(task._executor._processes.values())
    task.close()
    for p in procs:
        p.join(timeout=10)
    assert task._executor is None and not any(p.is_alive() for p in procs)
