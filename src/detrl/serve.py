"""An HTTP server that speaks the subset of SGLang's protocol detrl uses, backed by the embedded engine.

    python -m detrl.serve --model-path outputs/runs/<run>/checkpoint-final --port 30000 [--deterministic]

For tests, and for CPU users who want process-level rollout workers: `rollout=sglang
rollout.sglang.urls=[http://127.0.0.1:30000]` trains against it exactly as against SGLang. Endpoints and
shapes follow SGLang's: POST /generate (input_ids, per-item sampling_params with sampling_seed,
return_logprob, rid) -> [{text, output_ids, meta_info: {id, finish_reason: {type}, prompt_tokens,
completion_tokens, output_token_logprobs: [[logprob, token_id, null], ...]}}], POST /update_weights_from_disk,
GET|POST /flush_cache, GET /health_generate, POST /abort_request, /pause_generation, /continue_generation,
GET /get_model_info.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from detrl.config import ModelConfig
from detrl.determinism import setup
from detrl.models.build import build_model
from detrl.rollout.base import Request, SamplingParams
from detrl.rollout.embedded import EmbeddedEngine


def _sampling(sp: dict[str, Any], cap: int) -> SamplingParams:
    return SamplingParams(float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)),
                          int(sp.get("max_new_tokens", cap)), tuple(sp.get("stop_token_ids") or ()))


def make_app(engine: EmbeddedEngine, model_path: str):
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="detrl.serve (SGLang protocol subset)")
    lock = threading.Lock()  # one generation at a time per server (its workers batch inside)
    paused = threading.Event()

    @app.post("/generate")
    def generate(body: dict[str, Any]):
        ids = body.get("input_ids")
        if ids is None:
            raise HTTPException(400, "input_ids is required (text prompts are not supported)")
        single = bool(ids) and isinstance(ids[0], int)
        ids = [ids] if single else ids
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * len(ids)
        rids = body.get("rid") or [str(i) for i in range(len(ids))]
        rids = [rids] if isinstance(rids, str) else rids
        shared = {(s.get("temperature", 1.0), s.get("top_p", 1.0), tuple(s.get("stop_token_ids") or ())) for s in sps}
        if len(shared) != 1:
            raise HTTPException(400, "all items of one /generate call must share temperature, top_p, stop_token_ids")
        if paused.is_set():
            raise HTTPException(503, "generation is paused")
        cap = engine.params.max_new_tokens
        reqs = [Request(i, 0, tuple(p), sp.get("sampling_seed"), (), int(sp.get("max_new_tokens", cap)))
                for i, (p, sp) in enumerate(zip(ids, sps))]
        with lock:
            engine.params = _sampling(sps[0], cap)
            try:
                results = engine.generate(reqs)
            finally:
                engine.params = SamplingParams(engine.params.temperature, engine.params.top_p, cap,
                                               engine.params.stop_token_ids)
        by_index = {r.request.prompt_uid: r for r in results}
        out = []
        for i, rid in enumerate(rids):
            r = by_index[i]
            reason = r.finish_reason
            if reason == "abort" and len(r.tokens) == reqs[i].max_new_tokens:
                reason = "length"  # SGLang's word for reaching the request's max_new_tokens
            out.append({"text": "", "output_ids": r.tokens, "meta_info": {
                "id": rid, "finish_reason": {"type": reason}, "prompt_tokens": len(ids[i]),
                "completion_tokens": len(r.tokens),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.tokens)],
            }})
        return out[0] if single else out

    @app.post("/update_weights_from_disk")
    def update_weights(body: dict[str, Any]):
        path = Path(body["model_path"])
        try:
            state = load_file(str(path / "model.safetensors") if path.is_dir() else str(path))
        except Exception as e:  # noqa: BLE001 - reported to the client
            return {"success": False, "message": f"could not load {path}: {e}"}
        with lock:
            engine.update_weights(state)
        return {"success": True, "message": f"loaded {path}", "weight_version": body.get("weight_version")}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache():
        return {"success": True}  # the embedded engine keeps no cache between calls

    @app.get("/health_generate")
    def health_generate():
        with lock:
            engine.generate([Request(0, 0, (1,), 0, (), 1)])
        return {"status": "ok"}

    @app.post("/abort_request")
    def abort_request(body: dict[str, Any]):
        engine._abort.set()  # running batches stop at their next token
        return {"success": True}

    @app.post("/pause_generation")
    def pause_generation(body: dict[str, Any] | None = None):
        paused.set()
        engine._abort.set()
        return {"success": True}

    @app.post("/continue_generation")
    def continue_generation(body: dict[str, Any] | None = None):
        paused.clear()
        engine._abort.clear()
        return {"success": True}

    @app.get("/get_model_info")
    def get_model_info():
        return {"model_path": model_path, "is_generation": True}

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m detrl.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="Hugging Face checkpoint dir (default: a fresh tiny Qwen3)")
    ap.add_argument("--model", default="qwen3", choices=["qwen3", "qwen3_moe"], help="architecture without --model-path")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant kernels and fixed routing")
    ap.add_argument("--random-seed", type=int, default=0)
    ap.add_argument("--ctx-len", type=int, default=16, help="fixed key length (must match the trainer's)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--max-batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    import uvicorn

    det = setup(args.deterministic, args.random_seed)
    cfg = ModelConfig(name=args.model, path=args.model_path)
    model = build_model(cfg, seed=args.random_seed)
    engine = EmbeddedEngine(model, det.ops, args.ctx_len, SamplingParams(max_new_tokens=args.max_new_tokens),
                            seed=args.random_seed, num_workers=args.num_workers, max_batch_size=args.max_batch_size,
                            fixed_routing=det.fixed_routing)
    torch.set_grad_enabled(False)
    uvicorn.run(make_app(engine, args.model_path or f"<fresh {args.model}>"), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
