"""The state SGLang's TokenizerManager and Scheduler hold for /generate, over one embedded engine.

Paths below are relative to `sglang/srt/` of SGLang 0.5.23; `app.py` puts it behind HTTP (`python -m detrl.serve`).
The engine is driven through its public interface only: `generate(requests, params)`, `abort()` (cut the call
in flight), `update_weights(state_dict)`. The server keeps its own copy of the model: weights are loaded into
it from disk (all or nothing) and then handed to the engine.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.sglang.requests import normalize, refuse_unserved, sampling
from detrl.rollout.sglang.weights import load_weights_from_disk

log = logging.getLogger("detrl.serve")

SGLANG_VERSION = "0.5.23"  # the protocol this file follows
DEFAULT_SAMPLING_SEED = 42  # sampling/sampling_batch_info.py SamplingBatchInfo.from_schedule_batch
PAUSE_MODES = ("abort", "retract", "in_place")  # managers/io_struct.py PauseGenerationReqInput.mode
GREEDY_TOP_P = 1e-30  # a nucleus of one token (top_k=1): the engine keeps the argmax; > 0 in float32
_INTERRUPT_POLL_S = 0.02


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the stand-in (SGLang has no such limits; a shared CPU box needs them)."""

    max_request_items: int = 1024  # sequences per /generate, after n's expansion
    max_body_bytes: int = 8 << 20
    weights_root: str = (
        tempfile.gettempdir()
    )  # /update_weights_from_disk reads only below it (the client's dir)


@dataclass
class _Item:
    """One sub-request (SGLang's ReqState): its rid, prompt, resolved sampling and the tokens so far."""

    rid: str
    prompt: tuple[int, ...]
    sp: dict[str, Any]  # as sent; resolved by `Server._validate`
    return_logprob: bool
    seed: int | None = None
    stops: tuple[int, ...] = ()
    max_new: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    stage: str = "tokenizer"  # tokenizer (before the pause gate) | queued | running | held | done
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    aborted: str | None = None  # the abort message once aborted
    retractions: int = 0


class _Error(Exception):
    def __init__(self, status: int, content: Any):
        super().__init__(str(content))
        self.status, self.content = status, content


def _value_error(message: str) -> _Error:
    """entrypoints/http_server.py `_create_error_response`: a ValueError -> 400 {"error": {"message"}}."""
    return _Error(400, {"error": {"message": message}})


def _abort_reason(message: str) -> dict[str, Any]:
    """A running request: scheduler.py abort_request sets FINISH_ABORT() (managers/schedule_batch.py, to_json);
    a waiting one: tokenizer_manager.py `_handle_abort_req` builds {type, message: "Abort in waiting queue"}."""
    if message == "Aborted":
        return {"type": "abort", "message": message, "status_code": None, "err_type": None}
    return {"type": "abort", "message": message}


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = getattr(config, "eos_token_id", None)
    return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


class Server:
    """The state SGLang's TokenizerManager and Scheduler hold, over one engine and the server's model copy."""

    def __init__(
        self,
        engine: Any,
        model: torch.nn.Module,
        model_path: str,
        deterministic: bool,
        random_seed: int,
        ctx_len: int,
        dtype: str = "float32",
        argv: list[str] | None = None,
        limits: Limits = Limits(),
    ):
        self.engine, self.model, self.model_path, self.deterministic = (
            engine,
            model,
            model_path,
            deterministic,
        )
        self.random_seed, self.ctx_len, self.dtype, self.argv = random_seed, ctx_len, dtype, list(argv or [])
        self.limits = limits
        self.vocab_size = int(getattr(model.config, "vocab_size", 0) or 0)
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()  # one engine call (or weight load) at a time
        self.rid_to_state: dict[str, _Item] = {}
        self.paused, self.pause_mode = False, None
        self.calls = itertools.count(1)
        self.running_call = 0  # id of the engine call in progress (0: none)
        self.weight_version = "default"  # arg_groups/fields/serving.py weight_version

    # ----- /generate
    def generate(self, body: dict[str, Any]) -> Any:
        """tokenizer_manager.py generate_request: normalise, register the rids, wait while paused, validate, run."""
        try:
            norm = normalize(body)  # managers/io_struct.py normalize_batch_and_arguments
            refuse_unserved(body)
        except ValueError as e:
            raise _value_error(str(e)) from None
        if len(norm.subs) > self.limits.max_request_items:
            raise _value_error(
                f"the request asks for {len(norm.subs)} sequences; this server takes at most "
                f"{self.limits.max_request_items} per request (--max-request-items)"
            )
        items = [_Item(s.rid, s.input_ids, s.sampling_params, s.return_logprob) for s in norm.subs]
        with self.cond:  # tokenizer_manager.py `_init_req_state`: a rid held by a live request
            for rid in dict.fromkeys([*norm.rids, *(it.rid for it in items)]):
                if rid in self.rid_to_state:
                    raise _value_error(f"Duplicate request ID detected: {rid}")
            self.rid_to_state.update((it.rid, it) for it in items)
        try:
            with self.cond:  # wait while paused, then validate each (`_tokenize_one_request`)
                self.cond.wait_for(lambda: not self.paused)
                for it in items:
                    self._validate(it)
                    it.stage = "queued"
            self._run(items)
        finally:
            with self.cond:
                for it in items:
                    if self.rid_to_state.get(it.rid) is it:
                        del self.rid_to_state[it.rid]
        out = [self._output(it) for it in items]
        return out[0] if norm.single else out

    def _validate(self, it: _Item) -> None:
        """tokenizer_manager.py `_validate_one_request` (no auto-truncate), then `_create_tokenized_object`'s
        SamplingParams(**sp).normalize(None).verify(vocab_size); the resolved values go onto `it`."""
        n, mnt = len(it.prompt), it.sp.get("max_new_tokens")
        if n == 0:  # a row of a batch (io_struct.py refuses an empty single prompt with this message)
            raise _value_error("input_ids cannot be empty.")
        if n >= self.ctx_len:
            raise _value_error(
                f"The input ({n} tokens) is longer than the model's context length ({self.ctx_len} tokens)."
            )
        if mnt is not None and mnt + n > self.ctx_len:
            raise _value_error(
                f"Requested token count exceeds the model's maximum context length of {self.ctx_len} tokens. "
                f"You requested a total of {mnt + n} tokens: {n} tokens from the input messages and {mnt} "
                f"tokens for the completion. Please reduce the number of tokens in the input messages or the "
                f"completion to fit within the limit."
            )
        try:
            s = sampling(it.sp, self.vocab_size)
        except ValueError as e:
            raise _value_error(str(e)) from None
        bad = next((t for t in it.prompt if not 0 <= t < self.vocab_size), None)
        if (
            bad is not None
        ):  # SGLang does not check (its embedding would fault): worded as its token_ids_logprob check
            raise _value_error(
                f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {self.vocab_size})."
            )
        if self.deterministic:  # sampling_batch_info.py from_schedule_batch: seed or 42; else ignored
            it.seed = DEFAULT_SAMPLING_SEED if s["sampling_seed"] is None else int(s["sampling_seed"])
        if not s["ignore_eos"]:  # managers/schedule_batch.py Req._check_token_based_finish
            it.stops = tuple(
                dict.fromkeys([*sorted(s["stop_token_ids"] or ()), *_eos_ids(self.model.config)])
            )
        it.max_new = self.ctx_len - n if s["max_new_tokens"] is None else int(s["max_new_tokens"])
        greedy = s["top_k"] == 1  # __post_init__: temperature < 1e-6 -> temperature 1, top_k 1
        it.temperature, it.top_p = float(s["temperature"]), GREEDY_TOP_P if greedy else float(s["top_p"])

    def _settle_aborted(self, items: list[_Item]) -> None:
        """Requests aborted while queued or held finish now, with the tokens they have (caller holds cond)."""
        for it in items:
            if it.finish is None and it.aborted is not None and it.stage != "running":
                it.finish, it.stage = _abort_reason(it.aborted), "done"

    def _run(self, items: list[_Item]) -> None:
        """Run until every item is finished: interrupted batches (pause, another rid's abort) continue."""
        while True:
            with self.cond:
                self.cond.wait_for(
                    lambda: (
                        not self.paused
                        or all(it.finish is not None or it.aborted is not None for it in items)
                    )
                )
                self._settle_aborted(items)
                if all(it.finish is not None for it in items):
                    return
            with self.engine_lock, self.cond:
                self._settle_aborted(items)
                todo = [it for it in items if it.finish is None]
                if not todo:
                    return
                if self.paused:
                    continue
                self.running_call = next(self.calls)
                for it in todo:
                    it.stage = "running"
                self.cond.release()  # the engine runs without the state lock (aborts and pauses take it)
                try:
                    self._engine_call(todo)
                finally:
                    self.cond.acquire()
                    self.running_call = 0
                    for it in todo:
                        if it.finish is None and it.aborted is not None:
                            it.finish = _abort_reason(it.aborted)
                        if it.finish is not None:
                            it.stage = "done"
                        else:  # cut by a pause (retracted / held in place) or by another request's abort
                            it.stage = "held" if self.paused else "queued"
                            it.retractions += self.paused and self.pause_mode == "retract"
                    self.cond.notify_all()

    def _engine_call(self, todo: list[_Item]) -> None:
        """One pass of the engine over `todo`, grouped by the sampling knobs one engine call shares."""
        groups: dict[tuple, list[_Item]] = {}
        for it in todo:
            key = (it.temperature, it.top_p, it.stops)
            groups.setdefault(key, []).append(it)
        for (temperature, top_p, stops), group in groups.items():
            for it in [it for it in group if it.max_new - len(it.tokens) <= 0]:
                it.finish = {"type": "length", "length": it.max_new}
            group = [it for it in group if it.finish is None]
            if not group:
                continue
            cap = max(it.max_new for it in group)
            fits = max(len(it.prompt) for it in group) + cap <= self.ctx_len
            for part in [group] if fits else [[it] for it in group]:  # each item fits on its own (_validate)
                self._engine_pass(
                    part, SamplingParams(temperature, top_p, max(it.max_new for it in part), stops)
                )

    def _engine_pass(self, part: list[_Item], params: SamplingParams) -> None:
        reqs = [
            Request(i, 0, it.prompt, it.seed, tuple(it.tokens), it.max_new - len(it.tokens))
            for i, it in enumerate(part)
        ]
        for r in self.engine.generate(reqs, params):
            it = part[r.request.prompt_uid]
            it.tokens += r.tokens
            it.logprobs += r.logprobs
            if r.finish_reason == "stop":  # schedule_batch.py FINISH_MATCHED_TOKEN (stop token beats length)
                it.finish = {"type": "stop", "matched": it.tokens[-1]}
            elif len(it.tokens) >= it.max_new:  # FINISH_LENGTH(length=max_new_tokens)
                it.finish = {"type": "length", "length": it.max_new}

    def _output(self, it: _Item) -> dict[str, Any]:
        """managers/tokenizer_manager.py `_handle_batch_output` (meta_info) with return_logprob's output_token_logprobs."""
        meta: dict[str, Any] = {
            "id": it.rid,
            "finish_reason": it.finish,
            "prompt_tokens": len(it.prompt),
            "weight_version": self.weight_version,
            "num_retractions": it.retractions,
            "completion_tokens": len(it.tokens),
        }
        if it.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(it.logprobs, it.tokens)]
        return {"text": "", "output_ids": list(it.tokens), "meta_info": meta}

    # ----- aborts, pause, continue
    def _interrupt_running(self) -> None:
        """Cut the engine call in progress at its next token and wait until it returned (caller holds cond)."""
        call = self.running_call
        while call and self.running_call == call:
            self.engine.abort()  # a call that starts clears it: repeated until this call is back
            self.cond.wait(_INTERRUPT_POLL_S)

    def abort(self, rid: str, abort_all: bool) -> None:
        """tokenizer_manager.abort_request + scheduler.abort_request: an empty rid without abort_all is ignored; a rid
        no live request holds is a no-op; else every queued / running / held request whose rid starts with it
        (abort_all: every one) is aborted. A request still at the pause gate has not reached the scheduler."""
        with self.cond:
            if not abort_all and (not rid or rid not in self.rid_to_state):
                return
            hit = [
                it
                for it in self.rid_to_state.values()
                if it.finish is None
                and it.stage in ("queued", "running", "held")
                and (abort_all or it.rid.startswith(rid))
            ]
            for it in hit:
                it.aborted = (
                    "Aborted"
                    if it.stage == "running" or (it.stage == "held" and self.pause_mode == "in_place")
                    else "Abort in waiting queue"
                )
            if any(it.stage == "running" for it in hit):
                self._interrupt_running()
            self.cond.notify_all()

    def pause(self, mode: str) -> None:
        """tokenizer_manager.pause_generation: "abort" aborts everything in flight and returns once none runs;
        "retract" / "in_place" stop the scheduler, the running requests resume at /continue_generation."""
        with self.cond:
            self.paused, self.pause_mode = True, mode
        if mode == "abort":
            self.abort("", abort_all=True)
        with self.cond:
            self._interrupt_running()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    # ----- weights, cache, info
    def flush_cache(self) -> bool:
        """scheduler.py flush_cache: refused while requests run or wait (waiting ignored when paused)."""
        with self.cond:
            busy = [it for it in self.rid_to_state.values() if it.stage in ("queued", "running", "held")]
            if (
                self.paused
            ):  # is_fully_idle(ignore_waiting=paused): only in_place-held requests stay "running"
                busy = [
                    it
                    for it in busy
                    if it.stage == "running" or (it.stage == "held" and self.pause_mode == "in_place")
                ]
            return not busy

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[bool, str]:
        """tokenizer_manager.update_weights_from_disk (waits for running requests unless paused) ->
        managers/scheduler_components/weight_updater.py update_weights_from_disk (+ flush_cache_after_weight_update)."""
        path = body.get("model_path")
        if path is None:
            raise _Error(422, {"detail": "model_path is required"})
        root = Path(self.limits.weights_root).resolve()
        if (
            not Path(str(path)).resolve().is_relative_to(root)
        ):  # refused before looking: nothing about it leaks
            return (
                False,
                f"model_path is outside {root}, the only place this server loads from (--weights-root)",
            )
        if body.get("abort_all_requests", False):
            self.abort("", abort_all=True)
        with self.engine_lock:
            try:
                load_weights_from_disk(
                    self.model, str(path)
                )  # all or nothing: the old weights stay on failure
            except ValueError as e:
                log.error("%s", e)
                return False, str(e)
            self.engine.update_weights(self.model.state_dict())
            success, message = True, "Succeeded to update model weights."
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
            if body.get("flush_cache", True) and not self.flush_cache():
                success, message = (
                    False,
                    (
                        "Weights were updated, but the cache was not flushed because requests "
                        "are still running or queued. Retract or finish them, then call "
                        "/flush_cache."
                    ),
                )
            elif body.get("weight_version") is not None:
                message += f" Weight version updated to {body['weight_version']}."
        return success, message

    def server_info(self) -> dict[str, Any]:
        """entrypoints/http_server.py `server_info`: ServerArgs.resolved_dict() (utils/common.py build_server_info)
        + scheduler info + startup_time, internal_states, version. Only the fields below are reported; each is a
        ServerArgs field name (checked by tests/test_sglang_contract.py)."""
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "dtype": self.dtype,
            "random_seed": self.random_seed,
            "enable_deterministic_inference": self.deterministic,
            "context_length": self.ctx_len,
            "tp_size": 1,
            "dp_size": 1,
            "attention_backend": None,
            "sampling_backend": None,
            "weight_version": "default",
            "skip_tokenizer_init": True,
            "launch_command": " ".join(["python", "-m", "detrl.serve", *self.argv]),
            "internal_states": [{}],
            "version": SGLANG_VERSION,
            "frontend": "detrl.serve",
        }

    def model_info(self) -> dict[str, Any]:
        """entrypoints/http_server.py `model_info` (a subset)."""
        cfg = self.model.config
        return {
            "model_path": self.model_path,
            "served_model_name": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def health(self) -> None:
        """http_server.py health_generate: a 1-token request, answered at once if something is running."""
        with self.cond:
            if self.running_call:
                return
        with self.engine_lock:
            self.engine.generate([Request(0, 0, (0,), 0, (), 1)], SamplingParams(1.0, 1.0, 1, ()))
