"""Reward extractors on tricky answers; a reward that raises or hangs scores 0 and is counted."""

import os
import signal
import struct
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
        if response == "swallow":  # as math-verify's parser: every exception (a SIGALRM's too) is caught
            end = time.monotonic() + 20
            while time.monotonic() < end:
                try:
                    time.sleep(0.05)
                except BaseException:  # noqa: BLE001, S110
                    pass
        if response == "die":  # e.g. killed for memory: must never run in the trainer's process
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0 if response == answer else 0.0


def _warm(task):
    task.score_texts(["a"], "a")  # start the scoring processes, so that timings below exclude their startup
    task.pop_errors()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_reward_that_raises_hangs_or_swallows_the_timeout_scores_zero_and_is_counted(workers):
    task = _Flaky(["q"], ["a"])
    task.reward_workers, task.reward_timeout_s = workers, 1.0
    try:
        _warm(task)
        t0 = time.perf_counter()
        texts = ["a", "raise", "hang", "b", "swallow", "a"]
        assert task.score_texts(texts, "a") == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        # two deadlines of 1 s and at most a spare process's start, not 5 s + 20 s
        assert time.perf_counter() - t0 < 8.0
        assert task.pop_errors() == 3 and task.pop_errors() == 0
        assert len(task._scorer.workers) == max(1, workers) and task._scorer.killed == 2
    finally:
        task.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_response_that_kills_its_worker_scores_zero_and_is_not_rerun_here(workers):
    task = _Flaky(["q"], ["a"])
    task.reward_workers, task.reward_timeout_s = workers, 5.0  # no deadline in play: a loaded machine is slow
    try:
        assert task.score_texts(["a", "die", "b", "a", "die"], "a") == [1.0, 0.0, 0.0, 1.0, 0.0]
        assert task.pop_errors() == 2 and task._scorer.killed == 2
        assert task.score_texts(["b", "a"], "a") == [0.0, 1.0]  # fresh processes took the dead ones' place
    finally:
        task.close()


HANGS = [  # each ran for minutes in math-verify with its own timeouts off and a SIGALRM in place
    "$\\boxed{9^{9^{9^{9}}}}$",
    "$\\boxed{(10^{10})!}$",
    "$\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}$",
]


@pytest.mark.parametrize("workers", [0, 2])
def test_math_verify_hang_inputs_end_at_the_timeout_and_count_as_errors(workers):
    task = MathTask(["q"], ["3"], reward_timeout_s=2.0, reward_workers=workers)
    try:
        _warm(task)
        for text in HANGS:
            t0 = time.perf_counter()
            assert task.score_texts([text, "$\\boxed{3}$"], "3") == [0.0, 1.0]
            # the timeout plus a margin: a replacement process may still be starting on a loaded machine
            assert time.perf_counter() - t0 < 2.0 + 8.0, text
            assert task.pop_errors() == 1
    finally:
        task.close()


def test_the_pool_scores_math_rows_bitwise_as_in_process():
    responses = ["$\\boxed{0.5}$", "$\\boxed{\\frac{2}{4}}$", "$\\boxed{3}$", "no answer", "$x = \\frac12$"]
    direct = MathTask(["q"], ["\\frac{1}{2}"], reward_timeout_s=0.0)
    want = direct.score_texts(responses, "\\frac{1}{2}")
    assert direct._scorer is None  # no timeout, no workers: scored here
    for workers in (0, 2):
        rows = MathTask(["q"], ["\\frac{1}{2}"], reward_workers=workers)
        try:
            got = rows.score_texts(responses, "\\frac{1}{2}")
            assert [struct.pack("d", x) for x in got] == [struct.pack("d", x) for x in want]
            assert rows.pop_errors() == 0
        finally:
            rows.close()


def test_the_reward_pool_is_closed_with_the_task():
    task = _Flaky(["q"], ["a"])
    task.reward_workers = 2
    assert task.score_texts(["a", "b"], "a") == [1.0, 0.0]
    procs = [w.proc for w in task._scorer.workers]
    task.close()
    assert task._scorer is None and not any(p.is_alive() for p in procs)
    assert task.score_texts(["b", "a"], "a") == [0.0, 1.0]  # a new pool after close
    task.close()
