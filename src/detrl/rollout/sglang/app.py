"""`python -m detrl.serve`: an HTTP server answering the subset of SGLang 0.5.23's protocol detrl uses, over the
embedded engine.

    python -m detrl.serve --model-path outputs/runs/<run>/checkpoint-final --port 30000 [--deterministic]

For tests, and for CPU users who want process-level rollout workers: `rollout=sglang
rollout.sglang.urls=[http://127.0.0.1:30000]` trains against it as against SGLang. Behaviours are read from
SGLang's source (paths relative to `sglang/srt/`, cited at each place):

- POST /generate: FastAPI's type check of GenerateReqInput (422), the JSON contract gate (400 {"error": str}),
  then io_struct.py's normalisation (a string rid is a prefix per item, n samples per prompt) and the
  tokenizer manager's and SamplingParams' checks (400 {"error": {"message"}}); per-item sampling_params,
  temperature 0 greedy, rids held for the request's lifetime, SGLang's finish_reason dicts; `sampling_seed`
  honoured only with --deterministic (= --enable-deterministic-inference), which gives an unseeded request 42.
- POST /update_weights_from_disk: every *.safetensors of a directory below --weights-root, loaded by name as
  SGLang's Qwen3 loader does (all or nothing), then the cache flushed; failure -> 400 {success: false, message}.
- GET|POST /flush_cache: plain text. POST /abort_request {rid | abort_all}: empty 200.
- POST /pause_generation {mode: abort | retract | in_place} / POST /continue_generation: new requests wait.
- GET /server_info, /get_server_info (deprecated alias), /model_info, /get_model_info, /health, /health_generate.

Where it differs: no tokenizer (text prompts, stop strings refused as SGLang refuses them with
skip_tokenizer_init); knobs the engine lacks (top_k > 1, penalties, grammars) refused in one line; an
out-of-vocabulary input id refused (SGLang does not check); limits on body size and sequences per request
(413 / 400); one engine call at a time; a batch interrupted by a pause or by another request's abort is
continued from its tokens so far; /server_info reports only the fields in `Server.server_info`; float32 only.
Binds to 127.0.0.1 unless --host says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response

from detrl.rollout.sglang.contract import GenerateBody, contract_error
from detrl.rollout.sglang.server import PAUSE_MODES, Limits, Server, _Error


class _BodyLimit:
    """ASGI middleware: a body over `limit` bytes is answered 413 before the route reads it."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        chunks, size, more = [], 0, True
        while more:  # read it all here (bounded), then replay it to the app
            msg = await receive()
            chunks.append(msg)
            size += len(msg.get("body", b""))
            more = msg.get("more_body", False) and msg["type"] == "http.request"
            if size > self.limit or (declared is not None and int(declared) > self.limit):
                return await _too_large(send, self.limit)
        replay = iter(chunks)

        async def again():
            return next(replay, None) or await receive()

        return await self.app(scope, again, send)


async def _too_large(send, limit: int) -> None:
    import json

    body = json.dumps({"error": {"message": f"request body over {limit} bytes (--max-body-bytes)"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def make_app(server: Server):
    app = FastAPI(title="detrl.serve (SGLang protocol)")
    app.add_middleware(_BodyLimit, limit=server.limits.max_body_bytes)

    def answer(fn, *args):
        try:
            return fn(*args)
        except _Error as e:
            return JSONResponse(e.content, status_code=e.status)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateBody, request: Request):
        # http_server.py generate_request: FastAPI has type-checked `obj` (422); then the contract gate (400)
        body = await request.json()
        error = contract_error(body)
        if error is not None:
            return JSONResponse({"error": error}, status_code=400)
        return await run_in_threadpool(answer, server.generate, body)

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

    _control_routes(app, server)
    return app


def _control_routes(app: FastAPI, server: Server) -> None:
    """Aborts, pause / continue, info and health: SGLang's shapes (entrypoints/http_server.py)."""

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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m detrl.serve", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model-path", default=None, help="Hugging Face checkpoint dir (default: a fresh tiny Qwen3)"
    )
    ap.add_argument(
        "--model", default="qwen3", choices=["qwen3", "qwen3_moe"], help="architecture without --model-path"
    )
    ap.add_argument(
        "--host", default="127.0.0.1", help="loopback by default: the server has no authentication"
    )
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
        "--dtype", default="float32", choices=["float32", "float"], help="the engine computes in float32"
    )
    ap.add_argument("--ctx-len", type=int, default=16, help="fixed key length (must match the trainer's)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=64, help="sequences per engine batch")
    ap.add_argument(
        "--max-request-items", type=int, default=Limits.max_request_items, help="sequences per /generate"
    )
    ap.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    ap.add_argument(
        "--weights-root", default=Limits.weights_root, help="/update_weights_from_disk reads only below it"
    )
    return ap


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    import uvicorn

    from detrl.config import ModelConfig
    from detrl.determinism import setup
    from detrl.models.build import build_model
    from detrl.rollout.base import SamplingParams
    from detrl.rollout.embedded import EmbeddedEngine
    from detrl.runtime import ops_for

    det = setup(args.deterministic, args.random_seed)
    model = build_model(ModelConfig(name=args.model, path=args.model_path), seed=args.random_seed)
    engine = EmbeddedEngine(
        model,
        ops_for(det),
        args.ctx_len,
        SamplingParams(max_new_tokens=args.max_new_tokens),
        seed=args.random_seed,
        num_workers=args.num_workers,
        max_batch_size=args.max_batch_size,
        fixed_routing=det.fixed_routing,
    )
    torch.set_grad_enabled(False)
    limits = Limits(args.max_request_items, args.max_body_bytes, args.weights_root)
    server = Server(
        engine,
        model.eval().requires_grad_(False),
        args.model_path or f"<fresh {args.model}>",
        args.deterministic,
        args.random_seed,
        args.ctx_len,
        "float32",
        argv=sys.argv[1:] if argv is None else argv,
        limits=limits,
    )
    uvicorn.run(make_app(server), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
