from detrl.data import ArithmeticTask, build_tokenizer, exact_match_reward, load_tokenizer


def test_tokenizer_round_trip_and_offline_reload(tmp_path):
    tok = build_tokenizer()
    ids = tok("17+25=42", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8 and tok.decode(ids) == "17+25=42"
    assert tok.decode([tok.bos_token_id, *ids, tok.eos_token_id], skip_special_tokens=True) == "17+25=42"
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again("17+25=42", add_special_tokens=False)["input_ids"] == ids
    assert again.get_vocab() == tok.get_vocab()


def test_task_is_a_deterministic_function_of_the_seed():
    a, b, c = (ArithmeticTask(0, 9, ["+", "-"], seed=s) for s in (3, 3, 4))
    assert len(a) == 200
    assert [a[i].prompt for i in range(len(a))] == [b[i].prompt for i in range(len(b))]
    assert [a[i].prompt for i in range(len(a))] != [c[i].prompt for i in range(len(c))]
    for i in range(len(a)):
        x, rest = a[i].prompt[:-1], a[i].answer
        assert str(eval(x)) == rest  # noqa: S307 - our own generated arithmetic
    assert [p.index for p in a.batch(len(a) - 1, 3)] == [len(a) - 1, 0, 1]


def test_exact_match_reward():
    assert exact_match_reward("42", "42") == 1.0
    assert exact_match_reward("42 ", "42") == 1.0
    assert exact_match_reward("4", "42") == 0.0
    assert exact_match_reward("421", "42") == 0.0


_NO_DATASETS = """
import sys
import detrl.cli, detrl.trainer
from detrl.data import ArithmeticTask
task = ArithmeticTask(0, 9, ["+"], seed=0)
split = task.subset([3, 1])
print("datasets" in sys.modules, split[0].prompt == task[3].prompt)
ds = task.dataset
print("datasets" in sys.modules, ds[3] == {"prompt": task[3].prompt, "answer": task[3].answer}, len(ds) == len(task))
"""


def test_a_training_process_does_not_import_datasets_until_a_dataset_is_asked_for():
    """The arithmetic task (the default) and the trainer's imports leave `datasets` (with pandas and pyarrow:
    ~85 MiB of RSS in each process, each rank) unimported; `task.dataset` still gives the rows as a Dataset."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NO_DATASETS], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "True", "True", "True"], out.stdout
