"""The static baseline: each batch prefills together and decodes in lock step until its last row ends.

Rows are right-padded to the batch's longest context, every row holds a `[Hkv, ctx_len, D]` cache slab per layer
for the whole batch, finished rows keep computing until the batch ends, and a prompt's n samples each prefill and
store it again. Kept as the benchmark baseline and as `rollout.scheduler=static`: the schedule is fixed by the
batch cut alone (no arrival order, no preemption), which isolates what continuous batching changes.
"""

from __future__ import annotations

import os
import queue
import time
import traceback

import torch

from detrl.models.forward import KVCache, Weights, forward, log_probs, rope_tables
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams, cut_results
from detrl.rollout.batching import check_fits
from detrl.rollout.sampling import hashed_gumbel, noise_chunk, sample, stream_gumbel

POLL_S = 1.0  # how often a waiting worker checks that its engine is alive


class Sampler:
    """One replica's batch sampler: the shared weights, the ops, a stream for unseeded requests."""

    def __init__(
        self,
        weights: Weights,
        ops: Ops,
        ctx_len: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        abort,
    ):
        self.weights, self.ops, self.ctx_len, self.params = weights, ops, ctx_len, params
        self.rope = rope_tables(weights.config, ctx_len, dtype=weights.embed.dtype)  # in the compute dtype
        self.generator = generator
        self.abort = abort  # set: a running batch stops at its next token
        self.kv_bytes_peak = 0  # the largest batch cache held so far

    @torch.no_grad()
    def run_batch(self, requests: list[Request]) -> list[Result]:
        """Sample (or continue) a response for each request of one engine batch, in request order.

        A request with a `prefix` continues that partial response: prompt + prefix are prefilled with
        the current weights. It may generate up to `request.max_new_tokens` tokens in this call
        (finish "abort" when cut there unfinished), and up to `params.max_new_tokens` in all ("length").
        """
        p = self.params
        check_fits(requests, p, self.ctx_len)
        prompts, lens, room, limit, seeds = self._inputs(requests)
        cache = KVCache.empty(self.weights.config, len(requests), self.ctx_len, self.weights.embed.dtype)
        self.kv_bytes_peak = max(
            self.kv_bytes_peak, sum(t.numel() * t.element_size() for t in cache.k + cache.v)
        )
        tokens, logps, experts = self._decode(prompts, lens, limit, seeds, cache)
        sampled = tokens.shape[1]
        tok_mat, lp_mat = tokens.tolist(), logps.tolist()  # [B, T]: one copy out
        return cut_results(
            requests,
            tok_mat,
            lp_mat,
            limit,
            room,
            p.stop_token_ids,
            None if experts is None else experts[:, :sampled].numpy(),
        )

    def _inputs(self, requests: list[Request]):
        """-> (right-padded contexts [B, P], their lengths [B], tokens left before "length" per row, this call's
        limit per row, the seeds [B] or None)."""
        p, b = self.params, len(requests)
        ctxs = [r.prompt_ids + r.prefix for r in requests]
        lens = torch.tensor([len(c) for c in ctxs])  # [B]
        room = [p.max_new_tokens - len(r.prefix) for r in requests]  # tokens left before "length"
        limit = [
            min(m, r.max_new_tokens) if r.max_new_tokens is not None else m for m, r in zip(room, requests)
        ]
        prompts = torch.zeros(b, int(lens.max()), dtype=torch.long)  # right-padded [B, P]
        for i, c in enumerate(ctxs):
            prompts[i, : len(c)] = torch.tensor(c)
        seeded = [r.seed is not None for r in requests]
        if any(seeded) and not all(seeded):
            raise ValueError("a batch mixes seeded and unseeded requests")
        seeds = torch.tensor([r.seed for r in requests]) if all(seeded) else None
        return prompts, lens, room, limit, seeds

    def _decode(self, prompts, lens, limit: list[int], seeds, cache: KVCache):
        """Prefill, then decode in lock step until every row stopped or reached its limit.
        -> (tokens [B, T], logprobs [B, T], experts [B, T, layers, k] or None), T the steps run."""
        p, b = self.params, prompts.shape[0]
        stops = torch.tensor(p.stop_token_ids) if p.stop_token_ids else None
        last, ids = forward(
            self.weights, prompts, self.ops, self.ctx_len, self.rope, cache=cache, last=lens - 1, routes=True
        )  # [B, V]; MoE: [B, P, layers, k] (dense: None)
        route = (
            None if ids is None else ids[torch.arange(b), lens - 1]
        )  # [B, layers, k]: the pass sampling next
        steps = max(limit)
        tokens = torch.empty(b, max(steps, 1), dtype=torch.long)  # [B, T]
        logps = torch.empty(b, max(steps, 1))
        experts = (
            None if route is None else torch.empty(b, max(steps, 1), *route.shape[1:], dtype=torch.int16)
        )
        stopped = torch.zeros(b, dtype=torch.bool)  # rows that sampled a stop token
        finished_by = torch.tensor(limit)  # [B] row i is finished after step t once t + 1 >= limit[i]
        sampled = 0  # steps run
        # seeded noise is a hash of (seed, position, vocab id): the chunking changes no bit
        chunk = noise_chunk(b, self.weights.config.vocab_size)
        for t in range(steps):
            if self.abort.is_set():
                break
            if t % chunk == 0:  # the next chunk of steps' noise at once (bounded memory)
                noise = self._noise(seeds, lens + t, min(chunk, steps - t))  # [B, C, V]
            logp = log_probs(last, p.temperature)  # [B, V]
            tok = sample(logp, noise[:, t % chunk], p.top_p)  # [B]
            tokens[:, t] = tok
            logps[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
            if experts is not None:
                experts[:, t] = route
            sampled = t + 1
            if sampled == steps:
                break
            if stops is not None:
                stopped |= torch.isin(tok, stops)
                if bool((stopped | (finished_by <= sampled)).all()):
                    break
            pos = (lens + t)[:, None]
            last, ids = forward(
                self.weights,
                tok[:, None],
                self.ops,
                self.ctx_len,
                self.rope,
                cache=cache,
                positions=pos,
                routes=True,
            )
            last, route = last[:, 0], None if ids is None else ids[:, 0]
        return tokens[:, :sampled], logps[:, :sampled], experts

    def _noise(self, seeds: torch.Tensor | None, positions: torch.Tensor, steps: int) -> torch.Tensor:
        """Gumbel noise [B, steps, V] for the tokens at `positions` [B] onward. Seeded: a hash of (seed,
        position, vocab id), whichever batch or step computes it. Else the next draws of this sampler's stream."""
        vocab = self.weights.config.vocab_size
        if seeds is not None:
            return hashed_gumbel(seeds, positions[:, None] + torch.arange(steps)[None, :], vocab)
        return stream_gumbel(self.generator, (positions.shape[0], steps), vocab)


class _Worker:
    """One static worker process's loop state: the current generate call, and a group carried to the next batch."""

    def __init__(self, worker: int, sampler: Sampler, outbox, parent: int):
        self.worker, self.sampler, self.outbox, self.parent = worker, sampler, outbox, parent
        self.current, self.carry = None, None

    def start(self, call, stream_seed, params) -> None:
        if call != self.current:  # a new generate call: this worker's stream restarts from the engine's draw
            self.sampler.generator.manual_seed((stream_seed + self.worker) % 2**63)
            self.sampler.params, self.current = params, call

    def put(self, call, kind: str, rows) -> None:
        self.outbox.put((call, self.worker, kind, {"kv_bytes_peak": self.sampler.kv_bytes_peak}, rows))

    def run(self, call, items) -> None:
        try:
            results = self.sampler.run_batch([r for _, r in items])
            rows = [
                (i, r.tokens, r.logprobs, r.finish_reason, r.routed_experts)
                for (i, _), r in zip(items, results)
            ]
            self.put(call, "batch", rows)
        except Exception:  # noqa: BLE001 - the engine raises it
            self.outbox.put((call, self.worker, "error", {}, traceback.format_exc()))

    def wait(self, q):
        while True:
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                if os.getppid() != self.parent:
                    os._exit(0)

    def fixed(self, tasks) -> None:
        """Fixed routing: run each message's batches, as they were cut, until None."""
        while (msg := self.wait(tasks)) is not None:
            call, stream_seed, params, batches = msg
            self.start(call, stream_seed, params)
            for _, items in batches:
                self.run(call, items)

    def gather(self, inbox, items: list, window_s: float, max_batch_size: int) -> tuple[list, bool]:
        """Add what arrives within the window, up to a full batch. -> (items, whether None came)."""
        deadline = time.perf_counter() + window_s
        while len(items) < max_batch_size:
            try:
                nxt = inbox.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if nxt is None:
                return items, True
            if len(items) + len(nxt[3]) > max_batch_size:
                self.carry = nxt  # does not fit: it starts this worker's next batch
                break
            items = items + nxt[3]
        return items, False

    def dynamic(self, inbox, max_batch_size: int, window_s: float) -> None:
        """Dynamic routing: batch the prompt groups that arrive on the shared inbox, until None."""
        while True:
            group = self.carry or self.wait(inbox)
            if group is None:
                return
            self.carry = None
            call, stream_seed, params, items = group
            items, stop = self.gather(inbox, items, window_s, max_batch_size)
            self.start(call, stream_seed, params)
            if self.sampler.abort.is_set():  # cut: queued requests come back unstarted
                self.put(call, "unstarted", [(i, [], [], "abort", None) for i, _ in items])
            else:
                self.run(call, items)
            if stop:
                return


def serve_static(
    worker: int,
    sampler: Sampler,
    tasks,
    inbox,
    outbox,
    max_batch_size: int,
    window_s: float,
    parent: int,
    deterministic: bool,
) -> None:
    """A worker process: run what is routed to it until told to stop (None).

    Fixed routing: `tasks` brings (call, stream seed, params, [(batch no, [(index, request)])]). Dynamic:
    prompt groups (call, stream seed, params, [(index, request)]) arrive on the shared `inbox`. Each batch's results
    go back on `outbox` as (call, worker, kind, payload). A worker whose engine process is gone exits
    (a forked worker would otherwise keep that process's sockets open, e.g. a killed server's port).
    """
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(
        deterministic
    )  # determinism.torch_algorithms, as in the engine's process
    torch.utils.deterministic.fill_uninitialized_memory = False
    sampler.generator = torch.Generator()
    w = _Worker(worker, sampler, outbox, parent)
    if tasks is not None:
        w.fixed(tasks)
    else:
        w.dynamic(inbox, max_batch_size, window_s)
