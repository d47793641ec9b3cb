"""A /generate request after SGLang's normalisation and sampling checks (paths relative to `sglang/srt/`).

`normalize` is managers/io_struct.py GenerateReqInput.normalize_batch_and_arguments (the parts for input_ids);
`sampling` is sampling/sampling_params.py SamplingParams: __post_init__, normalize(tokenizer=None) (the stand-in
has no tokenizer: skip_tokenizer_init) and verify(vocab_size). Each raises ValueError with SGLang's message, which
http_server.py answers as 400 {"error": {"message"}}. Where SGLang would fail with a 500 (an IndexError or a
TypeError deep inside) or serve a feature the embedded engine lacks, a ValueError says so in SGLang's style.
"""

from __future__ import annotations

import math
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

TOP_K_ALL = 1 << 30  # sampling_params.py: the whole vocabulary
SAMPLING_EPS = 1e-6  # sampling_params.py _SAMPLING_EPS: a temperature below it is greedy
MAX_STOP_COUNT = 32
SKIP_TOKENIZER = "is unavailable when skip_tokenizer_init=True"
# GenerateRequest fields the embedded engine does not implement: refused unless null / their default
_UNSERVED = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "lora_path": None,
    "session_params": None, "session_id": None, "custom_logit_processor": None, "logprob_start_len": None,
    "top_logprobs_num": None, "token_ids_logprob": None, "return_hidden_states": None, "stream": False,
    "return_routed_experts": False, "return_sampling_mask": None, "max_thinking_tokens": None,
}  # fmt: skip
# sampling knobs the embedded engine does not implement, with the value that means "off" (after __post_init__)
_OFF = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "custom_params": None,
    "watermark": None, "beam_width": None, "choice": None,
}  # fmt: skip
_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": TOP_K_ALL, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "ignore_eos": False, "logit_bias": None,
    "sampling_seed": None, "beam_width": None, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "custom_params": None, "watermark": None, "choice": None,
}  # fmt: skip
# __post_init__: these None mean "the default"; max_new_tokens None stays None (the scheduler fills it)
_NONE_IS_DEFAULT = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty")
_NONE_IS_DEFAULT += ("repetition_penalty", "min_new_tokens", "n", "ignore_eos")


@dataclass(frozen=True)
class SubRequest:
    """One sequence to generate: io_struct.py GenerateReqInput.__getitem__ (one per parallel sample)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    return_logprob: bool


@dataclass(frozen=True)
class Normalized:
    single: bool  # answer one dict, not a list
    rids: tuple[str, ...]  # the rids registered for the call (tokenizer_manager.py `_init_req_state`)
    subs: tuple[SubRequest, ...]  # in answer order: prompt-major, its n samples together


def refuse_unserved(body: dict[str, Any]) -> None:
    for key, off in _UNSERVED.items():
        if body.get(key, off) != off:
            raise ValueError(f"detrl.serve does not implement {key}={body[key]!r}: leave it out")


def _parallel(sps: Any) -> int:
    """io_struct.py `_handle_parallel_sampling`: n of the (first) sampling params; a beam request is not fanned out."""
    if sps is None:
        return 1
    if isinstance(sps, list):
        if not sps:  # SGLang: IndexError (500)
            raise ValueError("sampling_params is an empty list: send one dict per input, or one dict for all")
        ns = [1 if sp.get("n") is None else sp["n"] for sp in sps]
        if any(n != ns[0] for n in ns):
            raise ValueError("The parallel_sample_num should be the same for all samples in sample params.")
        first = sps[0]
    else:
        ns, first = [1 if sps.get("n") is None else sps["n"]], sps
    if ns[0] < 1:  # SGLang: an empty expansion, then IndexError (500)
        raise ValueError(f"n must be at least 1, got {ns[0]}.")
    return 1 if (first.get("beam_width") or 1) > 1 else ns[0]


def _per_item(value: Any, default: Any, num: int, n: int, name: str) -> list:
    """io_struct.py `_normalize_logprob_params.normalize_param`."""
    if value is None:
        return [default] * num
    if not isinstance(value, list):
        return [value] * num
    if n > 1:
        raise ValueError(f"Cannot use list {name} with parallel_sample_num > 1")
    if len(value) != num:  # SGLang: IndexError (500)
        raise ValueError(f"{name} has {len(value)} entries for a batch of {num}")
    return value


def _batch_rids(rid: Any, batch: int, num: int) -> list[str]:
    """io_struct.py `_normalize_rid`: a string is a prefix, "<rid>_<i>" per item."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(num)]
    if isinstance(rid, list):
        if len(rid) != batch:
            raise ValueError("The specified rids length mismatch with the batch_size for batch processing.")
        return list(rid)
    raise ValueError("The rid should be a string or a list of strings.")


def normalize(body: dict[str, Any]) -> Normalized:
    """io_struct.py `normalize_batch_and_arguments` for input_ids; text needs the tokenizer the stand-in lacks."""
    ids, sps = body.get("input_ids"), body.get("sampling_params")
    if ids is None and body.get("text") is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    if ids is None:  # tokenizer_manager.py `_tokenize_one_request`
        raise ValueError(
            "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
            "input_ids or re-initialize the engine with skip_tokenizer_init=False."
        )
    if not ids:  # `_determine_batch_size` (no session supplies the prompt here)
        raise ValueError("input_ids cannot be empty.")
    single, n = isinstance(ids[0], int), _parallel(sps)
    if single and n == 1:
        if isinstance(sps, list) or isinstance(body.get("rid"), list):  # SGLang: a TypeError (500)
            raise ValueError("a single request takes one rid string and one sampling_params dict")
        rid = body.get("rid") or uuid.uuid4().hex
        lp = bool(body.get("return_logprob") or False)
        return Normalized(True, (rid,), (SubRequest(rid, tuple(ids), dict(sps or {}), lp),))
    prompts = [ids] if single else ids
    if not all(isinstance(p, list) for p in prompts):
        raise ValueError("input_ids should be a list of lists for batch processing.")
    batch = len(prompts)
    num = batch * n
    rids = _batch_rids(body.get("rid"), batch, num)
    if sps is None or isinstance(sps, dict):
        sps = [dict(sps or {})] * batch
    elif len(sps) != batch:  # SGLang: IndexError (500) or extra entries ignored
        raise ValueError(f"sampling_params has {len(sps)} entries for {batch} inputs")
    lps = _per_item(body.get("return_logprob"), False, num, n, "return_logprob")
    dups = [r for r, c in Counter(rids).items() if c > 1]
    if dups:  # `_validate_rid_uniqueness`
        raise ValueError(f"Duplicate request IDs detected within the request: {dups}")
    if n == 1:
        subs = [
            SubRequest(str(r), tuple(p), dict(sp), bool(lp)) for r, p, sp, lp in zip(rids, prompts, sps, lps)
        ]
    else:  # tokenizer_manager.py `_handle_batch_request`: every sample gets a fresh rid (regenerate_rid)
        subs = [
            SubRequest(uuid.uuid4().hex, tuple(prompts[i]), dict(sps[i]), bool(lps[i]))
            for i in range(batch)
            for _ in range(n)
        ]
    return Normalized(False, tuple(map(str, rids)), tuple(subs))


def _post_init(sp: dict[str, Any]) -> dict[str, Any]:
    """sampling_params.py SamplingParams.__post_init__: defaults, stop ids as a set, temperature 0 -> greedy."""
    s = {**_DEFAULTS, **sp}
    for k in _NONE_IS_DEFAULT:
        s[k] = _DEFAULTS[k] if s[k] is None else s[k]
    s["stop_token_ids"] = {int(t) for t in s["stop_token_ids"] or () if t is not None} or None
    s["top_k"] = -1 if s["top_k"] is None else s["top_k"]
    for k in ("json_schema", "regex", "ebnf", "structural_tag"):
        s[k] = s[k] or None
    if 0 <= s["temperature"] < SAMPLING_EPS:  # top_k = 1 means greedy sampling
        s["temperature"], s["top_k"] = 1.0, 1
    if s["top_k"] == -1:
        s["top_k"] = TOP_K_ALL
    return s


def _normalize_stops(s: dict[str, Any]) -> None:
    """sampling_params.py `normalize(tokenizer=None)` and `raise_if_tokenizer_required`."""
    stops = [s["stop"]] if isinstance(s["stop"], str) else s["stop"]
    regex = [s["stop_regex"]] if isinstance(s["stop_regex"], str) else s["stop_regex"]
    if stops is not None and len(stops) > MAX_STOP_COUNT:
        raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    if stops:
        raise ValueError(
            f"stop={stops!r} {SKIP_TOKENIZER} (requires tokenizer to decode tokens to text for matching)."
        )
    if regex:
        raise ValueError(
            f"stop_regex={regex!r} {SKIP_TOKENIZER} (requires tokenizer to decode tokens to text for matching)."
        )
    if s["min_new_tokens"] > 0:
        raise ValueError(
            f"min_new_tokens={s['min_new_tokens']} {SKIP_TOKENIZER} (requires tokenizer for eos_token_id)."
        )


def _verify(s: dict[str, Any], vocab_size: int) -> None:
    """sampling_params.py `SamplingParams.verify` (the checks that can fail on what the stand-in accepts)."""
    t, top_p, top_k, mnt, seed = (
        s["temperature"],
        s["top_p"],
        s["top_k"],
        s["max_new_tokens"],
        s["sampling_seed"],
    )
    if s["beam_width"] is not None and s["beam_width"] < 1:
        raise ValueError(f"beam_width must be at least 1, got {s['beam_width']}.")
    if not math.isfinite(t) or t < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if not 0.0 <= s["min_p"] <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {s['min_p']}.")
    if top_k < 1 or top_k == -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for k in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= s[k] <= 2.0:
            raise ValueError(f"{k} must be in [-2, 2], got {s[k]}.")
    if not 0.0 < s["repetition_penalty"] <= 2.0:
        raise ValueError(
            f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {s['repetition_penalty']}."
        )
    if not 0 <= s["min_new_tokens"]:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {s['min_new_tokens']}.")
    if mnt is not None and mnt < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {mnt}.")
    if mnt is not None and not s["min_new_tokens"] <= mnt:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({mnt})], got {s['min_new_tokens']}.")
    for token_id in s["logit_bias"] or {}:
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    if sum(s[k] is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")) > 1:
        raise ValueError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")


def sampling(sp: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    """SGLang's SamplingParams(**sp), normalize(None), verify(vocab_size) -> the resolved values.

    Then the knobs the embedded engine lacks must be off: top_k is the whole vocabulary or 1 (greedy, which the
    engine runs as the nucleus of one token), no penalties, grammars or logit bias."""
    s = _post_init(sp)
    _normalize_stops(s)
    _verify(s, vocab_size)
    if s["top_k"] not in (TOP_K_ALL, 1):
        raise ValueError(f"detrl.serve does not implement top_k={s['top_k']}: send -1 or 1 (greedy)")
    for k, off in _OFF.items():
        if s[k] != off and not (k == "beam_width" and s[k] == 1):
            raise ValueError(f"detrl.serve does not implement {k}={s[k]!r}: leave it out")
    if s["logit_bias"]:
        raise ValueError(f"detrl.serve does not implement logit_bias={s['logit_bias']!r}: leave it out")
    return s
