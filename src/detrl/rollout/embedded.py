"""The embedded engine: concurrent in-process workers, each batching the requests routed to it.

Like a serving engine with several replicas and dynamic batching: `generate` routes requests to
`num_workers` threads; each runs a KV-cache sampler over the functional Qwen3 forward on batches of up
to `max_batch_size` requests. With `fixed_routing` (determinism on) the requests, in submission order,
are cut into full batches and batch j goes to worker j mod num_workers. Without it (off) requests arrive one
prompt group at a time on a shared queue, a free worker takes what arrives within a short batching
window (first free, dynamic batch composition), and results come back in completion order.
"""

from __future__ import annotations

import copy
import queue
import threading
import time

import torch

from detrl.models.forward import KVCache, forward, fuse, log_probs, rope_tables
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.sampling import hashed_gumbel, sample, stream_gumbel

_DONE = None
_NOISE_CHUNK = 16  # decode steps whose sampling noise is drawn at once


class EmbeddedEngine:
    """Holds its own copy of the policy weights (synced by `update_weights`, as a serving engine would)."""

    def __init__(self, model: torch.nn.Module, ops: Ops, ctx_len: int, params: SamplingParams, seed: int,
                 num_workers: int = 1, max_batch_size: int = 64, fixed_routing: bool = True,
                 batch_window_s: float = 0.002):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.weights = fuse(self.model)  # what the forward runs on, rebuilt at each weight sync
        self.ops, self.ctx_len, self.params = ops, ctx_len, params
        self.num_workers, self.max_batch_size, self.fixed_routing = num_workers, max_batch_size, fixed_routing
        self.batch_window_s = batch_window_s
        self.rope = rope_tables(self.model.config, ctx_len)
        self.generator = torch.Generator().manual_seed(seed)  # the shared stream (requests without a seed)
        self.batch_log: list[tuple[int, tuple[tuple[int, int], ...]]] = []  # (worker, uids) per batch run
        self._abort = threading.Event()  # set: running batches stop at their next token, queued ones are not run

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)
        self.weights = fuse(self.model)

    def close(self) -> None:
        pass

    def generate(self, requests: list[Request], stop_when=None) -> list[Result]:
        """All requests through the workers. Fixed routing: results in request order; else completion order.

        `stop_when(results_so_far) -> bool` (dynamic routing only) is checked as batches complete; once
        true, running batches are cut at their next token and queued requests come back unstarted, all
        with finish reason "abort" (an async system's cut of a partial rollout).
        """
        self.batch_log = []
        self._abort.clear()
        if not requests:
            return []
        if self.fixed_routing:
            if stop_when is not None:
                raise ValueError("stop_when needs dynamic routing; with fixed routing cut by token budget")
            return self._generate_fixed(requests)
        return self._generate_dynamic(requests, stop_when)

    def _generate_fixed(self, requests: list[Request]) -> list[Result]:
        # the fixed rule: requests in submission (uid) order, cut into full batches, batch j -> worker j % W
        batches = [requests[lo : lo + self.max_batch_size] for lo in range(0, len(requests), self.max_batch_size)]

        def work(w: int) -> list[Result]:
            out = []
            for batch in batches[w :: self.num_workers]:
                out += self._logged_batch(w, batch)
            return out

        by_uid = {res.uid: res for shard in _run_threads(work, self.num_workers) for res in shard}
        return [by_uid[r.uid] for r in requests]

    def _generate_dynamic(self, requests: list[Request], stop_when=None) -> list[Result]:
        inbox: queue.Queue = queue.Queue()
        done: list[Result] = []
        lock = threading.Lock()

        def work(w: int) -> list[Result]:
            while True:
                first = inbox.get()
                if first is _DONE:
                    inbox.put(_DONE)  # let the other workers see it too
                    return []
                batch = [first]
                # what arrives within the batching window, up to a full batch (a server's max queue delay)
                deadline = time.perf_counter() + self.batch_window_s
                while len(batch) < self.max_batch_size:
                    try:
                        nxt = inbox.get(timeout=max(0.0, deadline - time.perf_counter()))
                    except queue.Empty:
                        break
                    if nxt is _DONE:
                        inbox.put(_DONE)
                        break
                    batch.append(nxt)
                if self._abort.is_set():  # cut: queued requests come back unstarted
                    results = [Result(r, [], [], "abort") for r in batch]
                else:
                    results = self._logged_batch(w, batch)
                with lock:
                    done.extend(results)  # completion order
                    if stop_when is not None and not self._abort.is_set() and stop_when(done):
                        self._abort.set()

        def feed() -> None:  # requests arrive one prompt group at a time
            group: list[Request] = []
            for r in requests:
                if group and r.prompt_uid != group[0].prompt_uid:
                    for g in group:
                        inbox.put(g)
                    group = []
                group.append(r)
            for g in group:
                inbox.put(g)
            inbox.put(_DONE)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        _run_threads(work, self.num_workers)
        feeder.join()
        return done

    def _logged_batch(self, worker: int, batch: list[Request]) -> list[Result]:
        self.batch_log.append((worker, tuple(r.uid for r in batch)))
        return self.run_batch(batch)

    @torch.no_grad()
    def run_batch(self, requests: list[Request]) -> list[Result]:
        """Sample (or continue) a response for each request of one engine batch, in request order.

        A request with a `prefix` continues that partial response: prompt + prefix are prefilled with
        the current weights. It may generate up to `request.max_new_tokens` tokens in this call
        (finish "abort" when cut there unfinished), and up to `params.max_new_tokens` in all ("length").
        """
        p = self.params
        b = len(requests)
        ctxs = [r.prompt_ids + r.prefix for r in requests]
        lens = torch.tensor([len(c) for c in ctxs])  # [B]
        room = [p.max_new_tokens - len(r.prefix) for r in requests]  # tokens left before "length"
        limit = [min(m, r.max_new_tokens) if r.max_new_tokens is not None else m for m, r in zip(room, requests)]
        if max(len(r.prompt_ids) for r in requests) + p.max_new_tokens > self.ctx_len:
            raise ValueError(f"a prompt + {p.max_new_tokens} new tokens exceeds ctx_len {self.ctx_len}")
        prompts = torch.zeros(b, int(lens.max()), dtype=torch.long)  # right-padded [B, P]
        for i, c in enumerate(ctxs):
            prompts[i, : len(c)] = torch.tensor(c)
        seeded = [r.seed is not None for r in requests]
        if any(seeded) and not all(seeded):
            raise ValueError("a batch mixes seeded and unseeded requests")
        seeds = torch.tensor([r.seed for r in requests]) if all(seeded) else None
        stops = torch.tensor(p.stop_token_ids) if p.stop_token_ids else None

        cache = KVCache.empty(self.model.config, b, self.ctx_len)
        last = forward(self.weights, prompts, self.ops, self.ctx_len, self.rope, cache=cache, last=lens - 1)  # [B, V]
        steps = max(limit)
        tokens = torch.empty(b, max(steps, 1), dtype=torch.long)  # [B, T]
        logps = torch.empty(b, max(steps, 1))
        stopped = torch.zeros(b, dtype=torch.bool)  # rows that sampled a stop token
        finished_by = torch.tensor(limit)  # [B] row i is finished after step t once t + 1 >= limit[i]
        sampled = 0  # steps run
        for t in range(steps):
            if self._abort.is_set():
                break
            if t % _NOISE_CHUNK == 0:  # the next chunk of steps' noise at once (bounded memory)
                noise = self._noise(seeds, lens + t, min(_NOISE_CHUNK, steps - t))  # [B, C, V]
            logp = log_probs(last, p.temperature)  # [B, V]
            tok = sample(logp, noise[:, t % _NOISE_CHUNK], p.top_p)  # [B]
            tokens[:, t] = tok
            logps[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
            sampled = t + 1
            if sampled == steps:
                break
            if stops is not None:
                stopped |= torch.isin(tok, stops)
                if bool((stopped | (finished_by <= sampled)).all()):
                    break
            last = forward(self.weights, tok[:, None], self.ops, self.ctx_len, self.rope, cache=cache,
                           positions=(lens + t)[:, None])[:, 0]
        tok_mat, lp_mat = tokens[:, :sampled].tolist(), logps[:, :sampled].tolist()  # [B, T]: one copy out
        stop_set = set(p.stop_token_ids)
        out = []
        for i, r in enumerate(requests):
            row = tok_mat[i][: limit[i]]
            n = next((j + 1 for j, x in enumerate(row) if x in stop_set), len(row))
            reason = "stop" if n and row[n - 1] in stop_set else "length" if n >= room[i] else "abort"
            out.append(Result(r, row[:n], lp_mat[i][:n], reason))
        return out

    def _noise(self, seeds: torch.Tensor | None, positions: torch.Tensor, steps: int) -> torch.Tensor:
        """Gumbel noise [B, steps, V] for the tokens at `positions` [B] onward. Seeded: a hash of (seed,
        position, vocab id), whichever batch or step computes it. Else the next draws of the shared stream."""
        vocab = self.model.config.vocab_size
        if seeds is not None:
            return hashed_gumbel(seeds, positions[:, None] + torch.arange(steps)[None, :], vocab)
        return stream_gumbel(self.generator, (positions.shape[0], steps), vocab)


def _run_threads(fn, n: int) -> list:
    """fn(i) for i in range(n) on n threads; re-raises the first worker error."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
        # one intra-op thread per worker: the workers are the parallelism (a new thread's own OpenMP
        # team would otherwise oversubscribe the cores: measured 2.8x slower on 2 cores)
        torch.set_num_threads(1)
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
