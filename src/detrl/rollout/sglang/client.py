"""Rollouts from SGLang servers (or anything speaking its protocol, e.g. `python -m detrl.serve`).

Attach with `rollout=sglang rollout.sglang.urls=[http://host:port,...]`. Same interface, ids, seeds and
ordering as the embedded engine: per-sample `sampling_seed`, requests cut into batches in submission order
with batch j -> server j mod S under fixed routing (determinism on), round-robin otherwise, results back
in request order.

Checked against SGLang 0.5.23 (paths relative to `sglang/srt/`):
- On attach each server's `/server_info` (entrypoints/http_server.py `server_info`: the resolved ServerArgs) must
  match the run: SGLang honours `sampling_seed` only with `enable_deterministic_inference` and then gives every
  unseeded request seed 42 (sampling/sampling_batch_info.py `from_schedule_batch`). determinism=on needs a
  deterministic server; determinism=off refuses one (rather than sending seeds of our own: an "off" run must
  measure a server that is nondeterministic). A served dtype other than the policy's is refused too.
- Weights sync through /update_weights_from_disk, which flushes the cache itself (flush_cache defaults to True;
  managers/scheduler_components/weight_updater.py) and answers 400 {success: false, message} on failure.
- Every /generate attempt has fresh rids: SGLang refuses a rid it still holds ("Duplicate request ID detected",
  managers/tokenizer_manager.py `_init_req_state`), as it does the rids of an attempt that timed out, which we
  abort. Connection errors, timeouts, 5xx and server-side aborts are retried with backoff; a 4xx is reported
  in one line; a server that stays down fails with its URL named.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.sglang.weights import save_weights

# ServerArgs --dtype values (arg_groups/fields/model.py) -> torch dtype; "auto" serves float32 checkpoints as float16
# (configs/model_config.py `_get_and_verify_dtype`)
_DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


HEALTH_PROGRESS_S = 30.0  # a server not yet healthy is named on stderr this often


class ServerError(RuntimeError):
    pass


def _one_line(text: str, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def _message(resp: httpx.Response) -> str:
    """The error of an SGLang answer in one line: {"message"} (weight updates), {"error": {"message"}}
    (http_server.py `_create_error_response`), {"detail"} (validation), or plain text (/flush_cache)."""
    try:
        j = resp.json()
    except ValueError:
        return _one_line(resp.text)
    if isinstance(j, dict):
        err = j.get("error")
        j = j.get("message") or (err.get("message") if isinstance(err, dict) else err) or j.get("detail") or j
    return _one_line(j)


def _json(resp: httpx.Response, url: str, path: str) -> object:
    try:
        return resp.json()
    except ValueError:
        raise ServerError(
            f"rollout server {url}{path} answered HTTP {resp.status_code} with a body that is not JSON: "
            f"{_one_line(resp.text, 120)!r}"
        ) from None


def _fields(item: object) -> tuple:
    """(finish kind, finish_reason, tokens, logprobs, rid) of one /generate item, or ServerError naming what is
    missing (SGLang's item: output_ids, meta_info {id, finish_reason, output_token_logprobs [[lp, id, text]]})."""
    meta = item.get("meta_info") if isinstance(item, dict) else None
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    if not isinstance(triples, list) or not all(isinstance(t, list) and len(t) == 3 for t in triples):
        raise ServerError(
            f"rollout server answered an item without meta_info.output_token_logprobs: {_one_line(item, 120)}"
        )
    fr, rid = meta.get("finish_reason"), meta.get("id")
    toks, lps = [t for _, t, _ in triples], [lp for lp, _, _ in triples]
    if toks != item.get("output_ids"):
        raise ServerError(
            f"rollout server answered rid {rid} with output_ids that its output_token_logprobs do not list"
        )
    return (fr.get("type") if isinstance(fr, dict) else fr), fr, toks, lps, rid


class SGLangEngine:
    def __init__(
        self,
        urls: list[str],
        params: SamplingParams,
        fixed_routing: bool,
        max_batch_size: int = 64,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        health_timeout_s: float = 120.0,
        procs: list | None = None,
        deterministic: bool | None = None,
        dtype: torch.dtype | None = None,
    ):
        if not urls:
            raise ValueError("rollout.sglang.urls is empty")
        self.procs = list(procs or [])  # servers we launched: shut down by close()
        self.urls = [u.rstrip("/") for u in urls]
        self.params, self.fixed_routing, self.max_batch_size = params, fixed_routing, max_batch_size
        self.deterministic = (
            fixed_routing if deterministic is None else deterministic
        )  # the run's determinism
        self.dtype = dtype  # the policy's dtype: the servers must serve it (None: not checked)
        self.retries, self.backoff_s = retries, backoff_s
        self.client = httpx.Client(timeout=timeout_s)
        self.generator = torch.Generator()  # no shared stream on this side: kept for the checkpoint format
        self._weights_dir = Path(tempfile.mkdtemp(prefix="detrl-weights-"))
        self._remove_weights = weakref.finalize(
            self, shutil.rmtree, str(self._weights_dir), True
        )  # also at exit
        self._version = 0
        try:
            for url in self.urls:
                self._wait_healthy(url, health_timeout_s)
                self._check_server(url)
        except BaseException:
            self.close()
            raise

    def _wait_healthy(self, url: str, timeout_s: float) -> None:
        """Poll /health_generate; every HEALTH_PROGRESS_S say on stderr which server is awaited."""
        start = time.time()
        deadline, report = start + timeout_s, start + HEALTH_PROGRESS_S
        while time.time() < deadline:
            try:
                if self.client.get(f"{url}/health_generate").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
            if any(p.poll() is not None for p in self.procs):
                raise ServerError(
                    f"rollout server {url} exited while starting (see its sglang-*.log in the run dir)"
                )
            if time.time() >= report:
                print(
                    f"detrl: waiting for rollout server {url} (/health_generate): {time.time() - start:.0f} s "
                    f"of {timeout_s:.0f} s (rollout.sglang.health_timeout_s)",
                    file=sys.stderr,
                    flush=True,
                )
                report += HEALTH_PROGRESS_S
        raise ServerError(
            f"rollout server {url} is not healthy after {timeout_s:.0f} s (/health_generate): is it running "
            "and reachable? (rollout.sglang.urls, rollout.sglang.health_timeout_s)"
        )

    def _check_server(self, url: str) -> None:
        """Refuse, in one line, a server whose sampling or dtype does not match this run."""
        info = None
        for path in ("/server_info", "/get_server_info"):  # the second: SGLang before /server_info existed
            try:
                resp = self.client.get(f"{url}{path}")
            except httpx.HTTPError as e:
                raise ServerError(f"rollout server {url}{path} failed: {e!r}") from e
            if resp.status_code == 200:
                info = _json(resp, url, path)
                break
        if not isinstance(info, dict):
            raise ServerError(
                f"rollout server {url} answers neither /server_info nor /get_server_info: "
                "cannot check its enable_deterministic_inference"
            )
        server_det = bool(info.get("enable_deterministic_inference", False))
        if self.deterministic and not server_det:
            raise ServerError(
                f"rollout server {url} runs without --enable-deterministic-inference, so it ignores "
                "sampling_seed, but determinism=on: relaunch it with the flag (or train with "
                "determinism=off)"
            )
        if not self.deterministic and server_det:
            raise ServerError(
                f"rollout server {url} runs with --enable-deterministic-inference, which gives every "
                "unseeded request sampling_seed 42 (n identical samples per prompt), but "
                "determinism=off: relaunch it without the flag (or train with determinism=on)"
            )
        served = str(info.get("dtype", "auto")).lower()
        want = self.dtype
        if want is not None and (
            _DTYPES.get(served, want) != want or (served == "auto" and want == torch.float32)
        ):
            name = str(want).removeprefix("torch.")
            raise ServerError(
                f"rollout server {url} serves dtype {served!r} but the policy is {name} (SGLang's "
                f"'auto' serves a float32 checkpoint as float16): relaunch it with --dtype {name}"
            )

    def _call(self, method: str, url: str, path: str, **kw):
        """One JSON call, retried on connection errors and 5xx; a 4xx raises with the server's message."""
        last = None
        for attempt in range(self.retries + 1):
            try:
                resp = self.client.request(method, f"{url}{path}", **kw)
            except httpx.HTTPError as e:
                last = repr(e)
            else:
                if resp.status_code < 400:
                    return _json(resp, url, path) if resp.content else None
                if resp.status_code < 500:
                    raise ServerError(
                        f"rollout server {url}{path} refused the request "
                        f"(HTTP {resp.status_code}): {_message(resp)}"
                    )
                last = f"HTTP {resp.status_code}: {_message(resp)}"
            time.sleep(self.backoff_s * 2**attempt)
        raise ServerError(f"rollout server {url} failed {self.retries + 1} times on {path}: {last}")

    def _payload(self, batch: list[Request], params: SamplingParams | None = None) -> dict:
        """One /generate body; its rids are new at every call (an attempt's rids are never reused)."""
        p = params or self.params
        sps = []
        for r in batch:
            budget = p.max_new_tokens - len(r.prefix)
            sp = {
                "temperature": p.temperature,
                "top_p": p.top_p,
                "stop_token_ids": list(p.stop_token_ids),
                "max_new_tokens": min(budget, r.max_new_tokens) if r.max_new_tokens is not None else budget,
                "skip_special_tokens": False,
                "no_stop_trim": True,
            }
            if r.seed is not None:
                sp["sampling_seed"] = r.seed
            sps.append(sp)
        # SGLang's abort matches rids by prefix (scheduler.py abort_request: rid.startswith): a fixed-length
        # suffix keeps one rid from being the prefix of another
        attempt = uuid.uuid4().hex
        return {
            "input_ids": [list(r.prompt_ids + r.prefix) for r in batch],
            "sampling_params": sps,
            "return_logprob": True,
            "rid": [f"{r.prompt_uid}-{r.sample_index}-{len(r.prefix)}-{attempt}" for r in batch],
        }

    def _abort_rids(self, url: str, rids: list[str]) -> None:
        """Best effort: free the rids of an attempt we gave up on (one AbortReq per rid, io_struct.py AbortReq)."""
        for rid in rids:
            try:
                self.client.post(f"{url}/abort_request", json={"rid": rid}, timeout=5.0)
            except httpx.HTTPError:
                return

    def _parse(
        self, batch: list[Request], out: object, params: SamplingParams | None = None
    ) -> tuple[list[Result], str | None]:
        """Results of one /generate answer, or the message of a request the server aborted. An answer that is
        not SGLang's shape (one item per request, each with output_ids and meta_info) raises ServerError."""
        limit = (params or self.params).max_new_tokens
        if not isinstance(out, list) or len(out) != len(batch):
            n = len(out) if isinstance(out, list) else type(out).__name__
            raise ServerError(f"rollout server answered {n} items for {len(batch)} requests")
        results = []
        for r, item in zip(batch, out):
            kind, fr, toks, lps, rid = _fields(item)
            if kind == "abort":
                return [], _one_line(fr.get("message", "aborted") if isinstance(fr, dict) else "aborted")
            if kind == "stop":
                reason = "stop"
            elif kind == "length":
                # the server's limit was this call's budget; "abort" = cut there unfinished (continued later)
                reason = "length" if len(r.prefix) + len(toks) >= limit else "abort"
            else:
                raise ServerError(f"rollout server answered rid {rid} with finish_reason {fr!r}")
            results.append(Result(r, toks, lps, reason))
        return results, None

    def _run(self, url: str, batch: list[Request], params: SamplingParams | None = None) -> list[Result]:
        last = None
        for attempt in range(self.retries + 1):
            payload = self._payload(batch, params)
            try:
                resp = self.client.post(f"{url}/generate", json=payload)
            except httpx.TimeoutException as e:
                self._abort_rids(url, payload["rid"])  # SGLang still holds them
                last = f"timed out ({e!r})"
            except httpx.HTTPError as e:
                last = repr(e)
            else:
                if resp.status_code == 200:
                    results, aborted = self._parse(batch, _json(resp, url, "/generate"), params)
                    if aborted is None:
                        return results
                    last = f"the server aborted the request: {aborted}"
                elif resp.status_code < 500:
                    raise ServerError(
                        f"rollout server {url}/generate refused the request "
                        f"(HTTP {resp.status_code}): {_message(resp)}"
                    )
                else:
                    last = f"HTTP {resp.status_code}: {_message(resp)}"
            time.sleep(self.backoff_s * 2**attempt)
        raise ServerError(f"rollout server {url} failed {self.retries + 1} times on /generate: {last}")

    def generate(
        self, requests: list[Request], params: SamplingParams | None = None, stop_when=None
    ) -> list[Result]:
        """`requests` in batches of max_batch_size, batch j -> server j mod S, sampled with `params` (None: the
        engine's); results in request order."""
        if stop_when is not None:
            raise ValueError("the SGLang backend cuts partial rollouts by token budget (determinism=on)")
        batches = [
            requests[i : i + self.max_batch_size] for i in range(0, len(requests), self.max_batch_size)
        ]
        targets = [self.urls[j % len(self.urls)] for j in range(len(batches))]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            parts = list(pool.map(lambda u, b: self._run(u, b, params), targets, batches))
        return [r for part in parts for r in part]

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Write the weights once, then have each server load them. SGLang flushes its cache in the same call
        (flush_cache=True), and a failed load answers 400 with its message: reported, not retried."""
        self._version += 1
        save_weights(state_dict, self._weights_dir)
        for url in self.urls:
            res = self._call(
                "POST",
                url,
                "/update_weights_from_disk",
                json={
                    "model_path": str(self._weights_dir),
                    "flush_cache": True,
                    "weight_version": str(self._version),
                },
            )
            res = res if isinstance(res, dict) else {}
            if not res.get("success", False):
                raise ServerError(
                    f"rollout server {url} could not load the weights: {_one_line(res.get('message'))}"
                )

    def close(self) -> None:
        """Also on errors and Ctrl-C (the trainer calls it in `finally`): stop the servers we launched and
        remove the weights directory."""
        self.client.close()
        self._remove_weights()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except Exception:  # noqa: BLE001
                p.kill()
