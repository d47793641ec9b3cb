"""An HTTP server that answers the subset of SGLang's protocol detrl uses as SGLang 0.5.23 does, over the embedded engine.

    python -m detrl.serve --model-path outputs/runs/<run>/checkpoint-final --port 30000 [--deterministic]

For tests, and for CPU users who want process-level rollout workers: `rollout=sglang
rollout.sglang.urls=[http://127.0.0.1:30000]` trains against it as against SGLang. Every behaviour below is
read from SGLang's source (paths relative to `sglang/srt/`, cited at each place):

- POST /generate: batched `input_ids`, per-item sampling_params (own max_new_tokens, stop_token_ids, ...),
  `rid`s registered for the request's lifetime ("Duplicate request ID detected: <rid>" -> HTTP 400),
  finish_reason as SGLang's dicts ({type: stop, matched}, {type: length, length}, {type: abort, message}),
  `sampling_seed` honoured only with --deterministic (= --enable-deterministic-inference), which gives an
  unseeded request seed 42.
- POST /update_weights_from_disk: every *.safetensors of a directory, loaded by name (tied embeddings as
  SGLang's Qwen3 loader ties them), then the cache flushed; failure -> HTTP 400 {success: false, message}.
- GET|POST /flush_cache: plain text. POST /abort_request {rid | abort_all}: empty 200.
- POST /pause_generation {mode: abort | retract | in_place} / POST /continue_generation: new requests wait.
- GET /server_info, /get_server_info (deprecated alias), /model_info, /get_model_info, /health, /health_generate.

Where it differs: no tokenizer (text prompts are refused, "text" is ""); one engine call at a time; a
running batch interrupted by a pause or by another request's abort is continued from its tokens so far
(prefix re-prefilled: the KV of an in_place pause is recomputed); /server_info reports only the fields
listed in `server_info()`; dtype is float32 only (the embedded engine's).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from detrl.config import ModelConfig
from detrl.determinism import setup
from detrl.models.build import build_model
from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.embedded import EmbeddedEngine

log = logging.getLogger("detrl.serve")

SGLANG_VERSION = "0.5.23"  # the protocol this file follows
DEFAULT_SAMPLING_SEED = 42  # sampling/sampling_batch_info.py SamplingBatchInfo.from_schedule_batch
PAUSE_MODES = ("abort", "retract", "in_place")  # managers/io_struct.py PauseGenerationReqInput.mode
_INTERRUPT_POLL_S = 0.02


def load_weights_from_disk(model: torch.nn.Module, model_path: str) -> None:
    """Load every *.safetensors of `model_path` into `model` by name, as SGLang's update does.

    model_executor/model_runner_components/weight_updater.py `update_weights_from_disk` -> model_loader/loader.py
    `DefaultModelLoader._prepare_weights` (a local dir: glob "*.safetensors", sorted; none -> RuntimeError
    "Cannot find any model weights with `<path>`") -> models/qwen3.py `load_weights`: a name the model lacks is
    skipped with a warning, a name not in the files keeps its old value, and with tie_word_embeddings the
    lm_head is the embedding module itself, so "model.embed_tokens.weight" loads both.
    Raises ValueError("Failed to get weights iterator: ...") / ValueError("Failed to update weights: ...").
    """
    from safetensors.torch import load_file

    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise ValueError(
            f"Failed to get weights iterator: Cannot find any model weights with `{model_path}`."
        )
    # named_parameters() lists a tied storage once, under its first name (model.embed_tokens.weight): the
    # lm_head of a tied model is no parameter of its own in SGLang's Qwen3 (models/qwen3.py Qwen3ForCausalLM)
    params = dict(model.named_parameters())
    staged: dict[str, torch.Tensor] = {}
    try:
        for f in files:
            for name, w in load_file(str(f)).items():
                if name not in params:
                    log.warning("Parameter %s not found in params_dict", name)
                    continue
                if w.shape != params[name].shape:
                    raise ValueError(f"{name}: shape {tuple(w.shape)} != {tuple(params[name].shape)}")
                staged[name] = w
    except Exception as e:  # noqa: BLE001 - SGLang rolls back and reports it
        raise ValueError(f"Failed to update weights: {e}.\nRolling back to original weights.") from e
    with torch.no_grad():
        for name, w in staged.items():
            params[name].copy_(w)  # copy_ casts to the served dtype, as weight_loader does


@dataclass
class _Item:
    """One sub-request (SGLang's ReqState): its rid, prompt, sampling and the tokens so far."""

    rid: str
    prompt: tuple[int, ...]
    sp: dict[str, Any]
    seed: int | None
    stops: tuple[int, ...]
    return_logprob: bool
    stage: str = "tokenizer"  # tokenizer (before the pause gate) | queued | running | held | done
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    aborted: str | None = None  # the abort message once aborted
    retractions: int = 0

    @property
    def max_new(self) -> int:
        return int(self.sp.get("max_new_tokens", 128))  # sampling/sampling_params.py: max_new_tokens = 128


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


class Server:
    """The state SGLang's TokenizerManager and Scheduler hold, over one embedded engine."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        model_path: str,
        deterministic: bool,
        random_seed: int,
        ctx_len: int,
        dtype: str = "float32",
        argv: list[str] | None = None,
    ):
        self.engine, self.model_path, self.deterministic = engine, model_path, deterministic
        self.random_seed, self.ctx_len, self.dtype, self.argv = random_seed, ctx_len, dtype, list(argv or [])
        self.cond = threading.Condition()
        self.engine_lock = threading.Lock()  # one engine call (or weight load) at a time
        self.rid_to_state: dict[str, _Item] = {}
        self.paused, self.pause_mode = False, None
        self.calls = itertools.count(1)
        self.running_call = 0  # id of the engine call in progress (0: none)
        self.weight_version = "default"  # arg_groups/fields/serving.py weight_version

    # ----- /generate
    def generate(self, body: dict[str, Any]) -> Any:
        ids = body.get("input_ids")
        if ids is None:
            raise _value_error("detrl.serve has no tokenizer: send input_ids")
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        n = len(prompts)
        sps = body.get("sampling_params") or {}
        sps = [dict(s or {}) for s in sps] if isinstance(sps, list) else [dict(sps) for _ in range(n)]
        rids = body.get("rid")
        if rids is None:  # managers/io_struct.py GenerateReqInput normalize: uuid4 hex
            rids = [uuid.uuid4().hex for _ in range(n)]
        rids = [rids] if isinstance(rids, str) else list(rids)
        if len(sps) != n or len(rids) != n:
            raise _value_error("sampling_params and rid must have one entry per input")
        lp = body.get("return_logprob", False)
        lps = [bool(x) for x in lp] if isinstance(lp, list) else [bool(lp)] * n
        items = [self._item(rid, p, sp, want) for rid, p, sp, want in zip(rids, prompts, sps, lps)]
        with self.cond:
            # managers/tokenizer_manager.py `_init_req_state`: a rid held by a live request, or twice in one batch
            seen: set[str] = set()
            for it in items:
                if it.rid in self.rid_to_state or it.rid in seen:
                    raise _value_error(f"Duplicate request ID detected: {it.rid}")
                seen.add(it.rid)
            self.rid_to_state.update((it.rid, it) for it in items)
        try:
            # tokenizer_manager.generate_request: wait while paused, then validate (`_validate_one_request`)
            with self.cond:
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
        return out[0] if single else out

    def _item(self, rid: str, prompt: list[int], sp: dict[str, Any], return_logprob: bool) -> _Item:
        seed = None
        if self.deterministic:  # sampling_batch_info.py from_schedule_batch: seed or 42; else ignored
            seed = sp.get("sampling_seed")
            seed = DEFAULT_SAMPLING_SEED if seed is None else int(seed)
        stops: tuple[int, ...] = ()
        if not sp.get("ignore_eos", False):  # managers/schedule_batch.py Req._check_token_based_finish
            eos = getattr(self.engine.model.config, "eos_token_id", None)
            eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            stops = tuple(dict.fromkeys([*(sp.get("stop_token_ids") or ()), *eos]))
        return _Item(str(rid), tuple(int(t) for t in prompt), sp, seed, stops, return_logprob)

    def _validate(self, it: _Item) -> None:
        """managers/tokenizer_manager.py `_validate_one_request` (no auto-truncate)."""
        if len(it.prompt) >= self.ctx_len:
            raise _value_error(
                f"The input ({len(it.prompt)} tokens) is longer than the model's context length "
                f"({self.ctx_len} tokens)."
            )
        if it.max_new + len(it.prompt) > self.ctx_len:
            raise _value_error(
                f"Requested token count exceeds the model's maximum context length of {self.ctx_len} tokens. "
                f"You requested a total of {it.max_new + len(it.prompt)} tokens: {len(it.prompt)} tokens from the "
                f"input messages and {it.max_new} tokens for the completion. Please reduce the number of tokens "
                f"in the input messages or the completion to fit within the limit."
            )
        if it.max_new < 0:
            raise _value_error(f"max_new_tokens must be at least 0, got {it.max_new}.")

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
            key = (float(it.sp.get("temperature", 1.0)), float(it.sp.get("top_p", 1.0)), it.stops)
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
        self.engine.params = params
        for r in self.engine.generate(reqs):
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
            self.engine._abort.set()  # the engine clears it when a call starts: set until this call is back
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
        if body.get("abort_all_requests", False):
            self.abort("", abort_all=True)
        with self.engine_lock:
            try:
                load_weights_from_disk(self.engine.model, str(path))
            except ValueError as e:
                log.error("%s", e)
                return False, str(e)
            self.engine.update_weights(self.engine.model.state_dict())
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
        cfg = self.engine.model.config
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
            self.engine.params = SamplingParams(1.0, 1.0, 1, ())
            self.engine.generate([Request(0, 0, (0,), 0, (), 1)])


def make_app(server: Server):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response

    app = FastAPI(title="detrl.serve (SGLang protocol)")

    def answer(fn, *args):
        try:
            return fn(*args)
        except _Error as e:
            return JSONResponse(e.content, status_code=e.status)

    @app.api_route("/generate", methods=["POST", "PUT"])
    def generate(body: dict[str, Any]):
        return answer(server.generate, body)

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: dict[str, Any]):
        def run():
            ok, message = server.update_weights_from_disk(body)
            # http_server.py update_weights_from_disk: 200 or 400, the same JSON
            return JSONResponse(
                {"success": ok, "message": message, "num_paused_requests": 0}, status_code=200 if ok else 400
            )

        return answer(run)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache(timeout: float = 0.0):
        # http_server.py flush_cache: plain text, 200 or 400
        if server.flush_cache():
            return Response(
                content="Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n",
                status_code=200,
            )
        return Response(content="Flush cache failed.\n", status_code=400)

    @app.post("/abort_request")
    def abort_request(body: dict[str, Any]):
        rid = body.get("rid") or ""  # io_struct.py AbortReq: rid None -> ""
        server.abort(str(rid), bool(body.get("abort_all", False)))
        return Response(status_code=200)

    @app.post("/pause_generation")
    def pause_generation(body: dict[str, Any]):
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return JSONResponse(
                {"detail": f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}"}, status_code=422
            )
        server.pause(mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    def continue_generation(body: dict[str, Any]):
        server.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.get("/server_info")
    @app.get("/get_server_info")  # deprecated alias, kept in 0.5.23
    def server_info():
        return server.server_info()

    @app.get("/model_info")
    @app.get("/get_model_info")  # deprecated alias, kept in 0.5.23
    def model_info():
        return server.model_info()

    @app.get("/health")
    @app.get("/health_generate")
    def health_generate():
        server.health()
        return Response(status_code=200)

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m detrl.serve", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model-path", default=None, help="Hugging Face checkpoint dir (default: a fresh tiny Qwen3)"
    )
    ap.add_argument(
        "--model", default="qwen3", choices=["qwen3", "qwen3_moe"], help="architecture without --model-path"
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--deterministic",
        "--enable-deterministic-inference",
        dest="deterministic",
        action="store_true",
        help="batch-invariant kernels, fixed routing, sampling_seed honoured (42 when absent)",
    )
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float"],
        help="served dtype (the embedded engine computes in float32 only)",
    )
    ap.add_argument("--ctx-len", type=int, default=16, help="fixed key length (must match the trainer's)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    import uvicorn

    det = setup(args.deterministic, args.random_seed)
    cfg = ModelConfig(name=args.model, path=args.model_path)
    model = build_model(cfg, seed=args.random_seed)
    engine = EmbeddedEngine(
        model,
        det.ops,
        args.ctx_len,
        SamplingParams(max_new_tokens=args.max_new_tokens),
        seed=args.random_seed,
        num_workers=args.num_workers,
        max_batch_size=args.max_batch_size,
        fixed_routing=det.fixed_routing,
    )
    torch.set_grad_enabled(False)
    server = Server(
        engine,
        args.model_path or f"<fresh {args.model}>",
        args.deterministic,
        args.random_seed,
        args.ctx_len,
        "float32",
        argv=sys.argv[1:] if argv is None else argv,
    )
    uvicorn.run(make_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
