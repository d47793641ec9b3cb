"""Rollouts from SGLang servers (or anything speaking its protocol, e.g. `python -m detrl.serve`).

Attach with `rollout=sglang rollout.sglang.urls=[http://host:port,...]`. Same interface, ids, seeds and
ordering as the embedded engine: per-sample `sampling_seed`, requests cut into batches in submission order
with batch j -> server j mod S under fixed routing (determinism on), round-robin otherwise, results back
in request order. Weights sync after each update through /update_weights_from_disk (+ flush_cache).
Connection errors and 5xx are retried with backoff; a server that stays down fails with its URL named.
"""

from __future__ import annotations

import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from detrl.rollout.base import Request, Result, SamplingParams


class ServerError(RuntimeError):
    pass


class SGLangEngine:
    def __init__(self, urls: list[str], params: SamplingParams, fixed_routing: bool, max_batch_size: int = 64,
                 timeout_s: float = 120.0, retries: int = 3, backoff_s: float = 0.5, health_timeout_s: float = 60.0,
                 procs: list | None = None):
        if not urls:
            raise ValueError("rollout.sglang.urls is empty")
        self.procs = list(procs or [])  # servers we launched: shut down by close()
        self.urls = [u.rstrip("/") for u in urls]
        self.params, self.fixed_routing, self.max_batch_size = params, fixed_routing, max_batch_size
        self.retries, self.backoff_s = retries, backoff_s
        self.client = httpx.Client(timeout=timeout_s)
        self.generator = torch.Generator()  # no shared stream on this side: kept for the checkpoint format
        self._weights_dir = Path(tempfile.mkdtemp(prefix="detrl-weights-"))
        self._version = 0
        try:
            for url in self.urls:
                self._wait_healthy(url, health_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if self.client.get(f"{url}/health_generate").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
            if any(p.poll() is not None for p in self.procs):
                raise ServerError(f"rollout server {url} exited while starting (see its sglang-*.log in the run dir)")
        raise ServerError(f"rollout server {url} is not healthy after {timeout_s:.0f} s (/health_generate)")

    def _call(self, method: str, url: str, path: str, **kw):
        last = None
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.request(method, f"{url}{path}", **kw)
                if resp.status_code < 500:
                    resp.raise_for_status()
                    return resp.json()
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPStatusError as e:
                raise ServerError(f"rollout server {url}{path} refused the request: {e.response.text[:200]}") from e
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(self.backoff_s * 2**attempt)
        raise ServerError(f"rollout server {url} failed {self.retries + 1} times on {path}: {last}")

    def _payload(self, batch: list[Request]) -> dict:
        p = self.params
        sps = []
        for r in batch:
            budget = p.max_new_tokens - len(r.prefix)
            sp = {"temperature": p.temperature, "top_p": p.top_p, "stop_token_ids": list(p.stop_token_ids),
                  "max_new_tokens": min(budget, r.max_new_tokens) if r.max_new_tokens is not None else budget,
                  "skip_special_tokens": False, "no_stop_trim": True}
            if r.seed is not None:
                sp["sampling_seed"] = r.seed
            sps.append(sp)
        return {"input_ids": [list(r.prompt_ids + r.prefix) for r in batch], "sampling_params": sps,
                "return_logprob": True, "rid": [f"{r.prompt_uid}-{r.sample_index}-{len(r.prefix)}" for r in batch]}

    def _run(self, url: str, batch: list[Request]) -> list[Result]:
        out = self._call("POST", url, "/generate", json=self._payload(batch))
        results = []
        for r, item in zip(batch, out):
            meta = item["meta_info"]
            toks = [t for _, t, _ in meta["output_token_logprobs"]]
            lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
            reason = meta["finish_reason"]["type"]
            if reason == "length" and len(r.prefix) + len(toks) < self.params.max_new_tokens:
                reason = "abort"  # cut by this call's budget, not by the response limit
            results.append(Result(r, toks, lps, reason))
        return results

    def generate(self, requests: list[Request], stop_when=None) -> list[Result]:
        if stop_when is not None:
            raise ValueError("the SGLang backend cuts partial rollouts by token budget (determinism=on)")
        batches = [requests[i : i + self.max_batch_size] for i in range(0, len(requests), self.max_batch_size)]
        targets = [self.urls[j % len(self.urls)] for j in range(len(batches))]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            parts = list(pool.map(self._run, targets, batches))
        return [r for part in parts for r in part]

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self._version += 1
        save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(self._weights_dir / "model.safetensors"))
        for url in self.urls:
            res = self._call("POST", url, "/update_weights_from_disk",
                             json={"model_path": str(self._weights_dir), "flush_cache": True,
                                   "weight_version": str(self._version)})
            if not res.get("success", False):
                raise ServerError(f"rollout server {url} could not load the weights: {res.get('message')}")
            self._call("POST", url, "/flush_cache")

    def close(self) -> None:
        """Also on errors and Ctrl-C (the trainer calls it in `finally`): stop the servers we launched."""
        self.client.close()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except Exception:  # noqa: BLE001
                p.kill()
