"""`data=<name>` -> a task (train split, with its held-out split as `.eval_task`), and the tokenizer to use.

One module per task: `arithmetic.py` (synthetic, the default), `gsm8k.py`, `math_task.py` (`data=math`).
File tasks read `data.path` (a parquet / jsonl / json file, or a dir of them) through `datasets`; the eval
split is `data.eval_path` when given, else `data.eval_fraction` of the rows held out by the seed.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from detrl.data.arithmetic import ArithmeticTask
from detrl.data.base import DataError, Task, column, load_rows, split_eval
from detrl.data.gsm8k import DEFAULT_TEMPLATE, GSM8KTask, gold_answer, to_number
from detrl.data.math_task import ANSWER_KEYS, PROMPT_KEYS, MathTask, gold_from
from detrl.guards import check_context

if TYPE_CHECKING:  # annotations only: the config's validation imports this registry
    from detrl.config import DataConfig, TrainConfig

TASK_NAMES = ("arithmetic", "gsm8k", "math")


def tokenizer_for(cfg: TrainConfig):
    """model.path's own tokenizer; else the project's character tokenizer (arithmetic) or the Qwen3-compatible one."""
    if cfg.model.path is not None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    if cfg.data.name == "arithmetic":
        from detrl.data.tokenizer import build_tokenizer

        return build_tokenizer()
    from detrl.data.qwen_tokenizer import build_qwen3_tokenizer

    return build_qwen3_tokenizer()


def stop_token_ids(tokenizer, model_path: str | None) -> tuple[int, ...]:
    """Every end-of-sequence id: the tokenizer's eos, and generation_config.json's / config.json's eos_token_id."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if model_path is not None:
        import json
        from pathlib import Path

        for name in ("generation_config.json", "config.json"):
            f = Path(model_path) / name
            if f.is_file():
                eos = json.loads(f.read_text()).get("eos_token_id")
                ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    out = tuple(dict.fromkeys(int(i) for i in ids))
    if not out:
        raise DataError(
            f"model.path={model_path!r}: no eos token id (tokenizer, generation_config.json, config.json)"
        )
    return out


def _file_task(d: DataConfig, path: str, key: str, seed: int) -> Task:
    ds = load_rows(path, key)
    pkey = d.prompt_key or (
        "question" if d.name == "gsm8k" else next((k for k in PROMPT_KEYS if k in ds.column_names), "prompt")
    )
    if d.answer_key:
        akey = d.answer_key
    elif d.name == "gsm8k":
        akey = "answer"
    else:
        akey = next((k for k in ANSWER_KEYS if k.split(".")[0] in ds.column_names), "answer")
    prompts = column(ds, pkey, "data.prompt_key", path)
    answers = _answers(column(ds, akey, "data.answer_key", path), d.name, akey, key, path)
    if d.name == "math":
        answers = [gold_from(a, akey) for a in answers]
    template = (
        d.prompt_template
        if d.prompt_template is not None
        else ("{prompt} " + DEFAULT_TEMPLATE if d.name == "gsm8k" else "{prompt}")
    )
    prompts = [_apply_template(template, p) for p in prompts]
    common = dict(
        chat_template=d.chat_template,
        enable_thinking=d.enable_thinking,
        system_prompt=d.system_prompt,
        reward_timeout_s=d.reward_timeout_s,
        reward_workers=d.reward_workers,
    )
    if d.name == "gsm8k":
        return GSM8KTask(prompts, answers, method=d.gsm8k_method, **common)
    return MathTask(prompts, answers, **common)


def _answers(values: list, task: str, akey: str, key: str, path: str) -> list[str]:
    """The gold answers as strings; a row without one (null, empty, for gsm8k not a number) refuses the file in
    one line naming the row (it would score 0 for every response, silently)."""
    for i, v in enumerate(values):
        bad = v is None or not str(v).strip() or (task == "gsm8k" and to_number(gold_answer(str(v))) is None)
        if bad:
            what = "no number after '####'" if task == "gsm8k" and v is not None else "no answer"
            raise DataError(
                f"{key}={path!r}: row {i} has {what} in column {akey!r} ({str(v)[-60:]!r}); fix or drop the row"
            )
    return [str(v) for v in values]


def positions_of(cfg: TrainConfig) -> int:
    """The model's positions: model.path's config.json, else model.max_position_embeddings."""
    if cfg.model.path is not None:
        import json
        from pathlib import Path

        f = Path(cfg.model.path) / "config.json"
        if f.is_file():
            return int(
                json.loads(f.read_text()).get("max_position_embeddings", cfg.model.max_position_embeddings)
            )
    return cfg.model.max_position_embeddings


def _check_positions(cfg: TrainConfig, splits: list[tuple[Task, str]], tokenizer) -> None:
    for task, key in splits:
        ids = task.encode_all(tokenizer)
        row = max(range(len(ids)), key=lambda i: len(ids[i]))
        prompt = task.render(tokenizer, task[row])
        where = f"the longest prompt of {key} ({prompt[:40]!r}...)"
        check_context(len(ids[row]), cfg.rollout.max_new_tokens, positions_of(cfg), where)


def _apply_template(template: str, prompt):
    """`{prompt}` in `data.prompt_template` stands for the row's prompt (the last user message of a chat)."""
    if isinstance(prompt, str):
        return template.replace("{prompt}", prompt)
    msgs = [dict(m) for m in prompt]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    msgs[last]["content"] = template.replace("{prompt}", msgs[last]["content"])
    return msgs


def _subset(task: Task, indices: list[int]) -> Task:
    if isinstance(task, ArithmeticTask):
        return task.subset(indices)
    out = type(task).__new__(type(task))
    out.__dict__.update(task.__dict__)
    Task.__init__(out, [task._prompts[i] for i in indices], [task._answers[i] for i in indices])
    return out


def build_task(cfg: TrainConfig, tokenizer) -> Task:
    """The train task of `data=`, its eval split attached as `.eval_task`; prompts encoded once."""
    d, seed = cfg.data, cfg.seed
    if d.name == "arithmetic":
        task = ArithmeticTask(d.min_operand, d.max_operand, list(d.ops), seed=seed)
        if d.eval_fraction > 0:
            train_idx, held = split_eval(len(task), d.eval_fraction, seed)
            task, held_task = task.subset(train_idx), task.subset(held)
        else:
            held_task = task  # the whole (generated) problem set
    else:
        task = _file_task(d, d.path, "data.path", seed)
        if d.eval_path:
            held_task = _file_task(d, d.eval_path, "data.eval_path", seed)
        elif d.eval_fraction > 0:
            train_idx, held = split_eval(len(task), d.eval_fraction, seed)
            task, held_task = _subset(task, train_idx), _subset(task, held)
        else:
            held_task = None
        if d.shuffle:
            order = list(range(len(task)))
            random.Random(f"data-order-{seed}").shuffle(order)
            task = _subset(task, order)
        task = _drop_long(task, tokenizer, d.max_prompt_length, "data.path")
        if held_task is not None:
            held_task = _drop_long(held_task, tokenizer, d.max_prompt_length, "data.eval_path")
    _check_positions(
        cfg, [(task, "data.path"), *([(held_task, "data.eval_path")] if held_task else [])], tokenizer
    )
    task.eval_task = held_task
    return task


def _drop_long(task: Task, tokenizer, limit: int, key: str) -> Task:
    """Rows whose prompt is longer than `data.max_prompt_length` tokens are left out (0: keep all)."""
    ids = task.encode_all(tokenizer)
    if limit <= 0:
        return task
    keep = [i for i, x in enumerate(ids) if len(x) <= limit]
    if not keep:
        raise DataError(f"data.max_prompt_length={limit}: every prompt of {key} is longer")
    if len(keep) == len(task):
        return task
    out = _subset(task, keep)
    out._ids = [ids[i] for i in keep]
    return out
