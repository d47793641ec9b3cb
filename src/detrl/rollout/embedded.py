"""The embedded engine: worker processes, each batching the requests routed to it.

Like a serving engine with data-parallel replicas and dynamic batching: `generate` routes requests to
`num_workers` worker processes (forked like DataLoader workers, one intra-op thread each: on CPU a
decode step is many small ops, and threads serialise on the GIL: measured, two threads ran two batches
slower than one thread ran them in turn). Each runs a KV-cache sampler over the functional Qwen3
forward on batches of up to `max_batch_size` requests, reading the policy weights from shared memory
that `update_weights` overwrites in place. With `fixed_routing` (determinism.routing=fixed) the requests, in
submission order, are cut into near-equal batches, as many as keep every worker busy, and batch j
goes to worker j mod num_workers. Without it (dynamic) prompt groups go to a shared queue, a free worker
takes what arrives within a short batching window (first free, dynamic batch composition), and
results come back in completion order. Unseeded requests draw from the serving worker's own stream,
reseeded at each call from the engine's `generator` (the state a checkpoint saves).
"""

from __future__ import annotations

import copy
import os
import queue
import sys
import time
import traceback
import weakref

import torch
import torch.multiprocessing as mp

from detrl.models.forward import KVCache, Weights, forward, fuse, log_probs, rope_tables
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams, cut_results
from detrl.rollout.sampling import hashed_gumbel, sample, stream_gumbel

_NOISE_CHUNK = 16  # decode steps whose sampling noise is drawn at once ...
_NOISE_ELEMENTS = (
    2**22
)  # ... while [B, steps, V] stays under this many values (a real vocab: 1 step at a time)
_POLL_S = 1.0  # how often a waiting engine checks that its workers are alive


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
        self.rope = rope_tables(
            weights.config, ctx_len, dtype=weights.embed.dtype
        )  # the trainer's: the compute dtype
        self.generator = generator
        self.abort = abort  # set: a running batch stops at its next token

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
        limit = [
            min(m, r.max_new_tokens) if r.max_new_tokens is not None else m for m, r in zip(room, requests)
        ]
        _check_fits(requests, p, self.ctx_len)
        prompts = torch.zeros(b, int(lens.max()), dtype=torch.long)  # right-padded [B, P]
        for i, c in enumerate(ctxs):
            prompts[i, : len(c)] = torch.tensor(c)
        seeded = [r.seed is not None for r in requests]
        if any(seeded) and not all(seeded):
            raise ValueError("a batch mixes seeded and unseeded requests")
        seeds = torch.tensor([r.seed for r in requests]) if all(seeded) else None
        stops = torch.tensor(p.stop_token_ids) if p.stop_token_ids else None

        cache = KVCache.empty(self.weights.config, b, self.ctx_len, self.weights.embed.dtype)
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
        chunk = max(1, min(_NOISE_CHUNK, _NOISE_ELEMENTS // (b * self.weights.config.vocab_size)))
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
            last, ids = forward(
                self.weights,
                tok[:, None],
                self.ops,
                self.ctx_len,
                self.rope,
                cache=cache,
                positions=(lens + t)[:, None],
                routes=True,
            )
            last, route = last[:, 0], None if ids is None else ids[:, 0]
        tok_mat, lp_mat = tokens[:, :sampled].tolist(), logps[:, :sampled].tolist()  # [B, T]: one copy out
        return cut_results(
            requests,
            tok_mat,
            lp_mat,
            limit,
            room,
            p.stop_token_ids,
            None if experts is None else experts[:, :sampled].numpy(),
        )

    def _noise(self, seeds: torch.Tensor | None, positions: torch.Tensor, steps: int) -> torch.Tensor:
        """Gumbel noise [B, steps, V] for the tokens at `positions` [B] onward. Seeded: a hash of (seed,
        position, vocab id), whichever batch or step computes it. Else the next draws of this sampler's stream."""
        vocab = self.weights.config.vocab_size
        if seeds is not None:
            return hashed_gumbel(seeds, positions[:, None] + torch.arange(steps)[None, :], vocab)
        return stream_gumbel(self.generator, (positions.shape[0], steps), vocab)


def _serve(
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
    current, carry = None, None

    def start(call, stream_seed, params) -> None:
        nonlocal current
        if call != current:  # a new generate call: this worker's stream restarts from the engine's draw
            sampler.generator.manual_seed((stream_seed + worker) % 2**63)
            sampler.params, current = params, call

    def run(call, items) -> None:
        try:
            results = sampler.run_batch([r for _, r in items])
            outbox.put(
                (
                    call,
                    worker,
                    "batch",
                    [
                        (i, r.tokens, r.logprobs, r.finish_reason, r.routed_experts)
                        for (i, _), r in zip(items, results)
                    ],
                )
            )
        except Exception:  # noqa: BLE001 - the engine raises it
            outbox.put((call, worker, "error", traceback.format_exc()))

    def wait(q):
        while True:
            try:
                return q.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent:
                    os._exit(0)

    while True:
        if tasks is not None:
            msg = wait(tasks)
            if msg is None:
                return
            call, stream_seed, params, batches = msg
            start(call, stream_seed, params)
            for _, items in batches:
                run(call, items)
            continue
        group = carry or wait(inbox)
        if group is None:
            return
        carry, stop = None, False
        call, stream_seed, params, items = group
        deadline = time.perf_counter() + window_s  # what arrives within the window, up to a full batch
        while len(items) < max_batch_size:
            try:
                nxt = inbox.get(timeout=max(0.0, deadline - time.perf_counter()))
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            if len(items) + len(nxt[3]) > max_batch_size:
                carry = nxt  # does not fit: it starts this worker's next batch
                break
            items = items + nxt[3]
        start(call, stream_seed, params)
        if sampler.abort.is_set():  # cut: queued requests come back unstarted
            outbox.put((call, worker, "unstarted", [(i, [], [], "abort", None) for i, _ in items]))
        else:
            run(call, items)
        if stop:
            return


class EmbeddedEngine:
    """Holds its own copy of the policy weights (synced by `update_weights`, as a serving engine would).

    The worker processes start at the first `generate` and stop at `close` (or when the engine is
    collected, or at exit).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ops: Ops,
        ctx_len: int,
        params: SamplingParams,
        seed: int,
        num_workers: int = 1,
        max_batch_size: int = 64,
        fixed_routing: bool = True,
        batch_window_s: float = 0.0005,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: need at least 1")
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ops, self.ctx_len, self.params = ops, ctx_len, params
        self.num_workers, self.max_batch_size, self.fixed_routing = num_workers, max_batch_size, fixed_routing
        self.batch_window_s = batch_window_s
        self.deterministic = (
            torch.are_deterministic_algorithms_enabled()
        )  # set by determinism.setup; workers copy it
        # the weights the workers read: shared memory, overwritten in place at each sync
        # in the compute dtype (ops.dtype: bf16 copies of float32 masters), as the trainer's forward fuses them
        self.weights = fuse(self.model, ops.dtype).map(lambda t: t.detach().clone().share_memory_())
        self.generator = torch.Generator().manual_seed(seed)  # the engine's stream (requests without a seed)
        self._ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
        self._abort = (
            self._ctx.Event()
        )  # set: running batches stop at their next token, queued ones are not run
        self.sampler = Sampler(
            self.weights, ops, ctx_len, params, torch.Generator().manual_seed(seed), self._abort
        )
        self.batch_log: list[tuple[int, tuple[tuple[int, int], ...]]] = []  # (worker, uids) per batch run
        self._procs: list = []
        self._call = 0

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)
        self.weights.copy_(fuse(self.model, self.ops.dtype))

    def abort(self) -> None:
        """Cut the call in flight: running batches stop at their next token, queued ones do not run."""
        self._abort.set()

    def run_batch(self, requests: list[Request]) -> list[Result]:
        """One engine batch in this process (what a worker runs), in request order."""
        self.sampler.params = self.params
        return self.sampler.run_batch(requests)

    def close(self) -> None:
        if self._procs:
            self._finalizer()
            self._procs = []

    def _start(self) -> None:
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self.close()
        self._outbox = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.num_workers)] if self.fixed_routing else None
        self._inbox = None if self.fixed_routing else self._ctx.Queue()
        for w in range(self.num_workers):
            sampler = Sampler(self.weights, self.ops, self.ctx_len, self.params, None, self._abort)
            tasks = self._tasks[w] if self._tasks else None
            p = self._ctx.Process(
                target=_serve,
                args=(
                    w,
                    sampler,
                    tasks,
                    self._inbox,
                    self._outbox,
                    self.max_batch_size,
                    self.batch_window_s,
                    os.getpid(),
                    self.deterministic,
                ),
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _shutdown, list(self._procs), self._tasks, self._inbox)

    def generate(
        self, requests: list[Request], params: SamplingParams | None = None, stop_when=None
    ) -> list[Result]:
        """All requests through the workers. Fixed routing: results in request order; else completion order.

        `stop_when(results_so_far) -> bool` (dynamic routing only) is checked as batches complete; once
        true, running batches are cut at their next token and queued requests come back unstarted, all
        with finish reason "abort" (an async system's cut of a partial rollout).
        """
        self.batch_log = []
        self._abort.clear()
        if not requests:
            return []
        if self.fixed_routing and stop_when is not None:
            raise ValueError("stop_when needs dynamic routing; with fixed routing cut by token budget")
        params = params or self.params  # this call's sampling (None: the engine's)
        _check_fits(requests, params, self.ctx_len)
        self._start()
        self._call += 1
        head = (self._call, int(torch.randint(0, 2**62, (1,), generator=self.generator)), params)
        indexed = list(enumerate(requests))
        if self.fixed_routing:
            batches = _fixed_batches(indexed, self.num_workers, self.max_batch_size)
            for w, tasks in enumerate(self._tasks):
                tasks.put((*head, [(j, batches[j]) for j in range(w, len(batches), self.num_workers)]))
        else:  # requests arrive one prompt group at a time (at most a batch each)
            groups: list[list] = []
            for i, r in indexed:
                if (
                    not groups
                    or r.prompt_uid != groups[-1][-1][1].prompt_uid
                    or len(groups[-1]) == self.max_batch_size
                ):
                    groups.append([])
                groups[-1].append((i, r))
            for g in groups:
                self._inbox.put((*head, g))
        done: list[Result] = []
        while len(done) < len(requests):
            worker, kind, payload = self._receive()
            results = [Result(requests[i], *out) for i, *out in payload]
            if kind == "batch":
                self.batch_log.append((worker, tuple(r.uid for r in results)))
            done += results  # completion order
            if stop_when is not None and not self._abort.is_set() and stop_when(done):
                self._abort.set()
        if self.fixed_routing:
            by_uid = {r.uid: r for r in done}
            return [by_uid[r.uid] for r in requests]
        return done

    def _receive(self):
        """The next batch of this call from any worker; a worker's error or death raises here."""
        while True:
            try:
                call, worker, kind, payload = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                dead = [(w, p.exitcode) for w, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"rollout worker {dead[0][0]} exited (code {dead[0][1]})") from None
                continue
            if call != self._call:
                continue  # left over from a call that raised
            if kind == "error":
                raise RuntimeError(f"rollout worker {worker} failed:\n{payload}")
            return worker, kind, payload


def _check_fits(requests: list[Request], params: SamplingParams, ctx_len: int) -> None:
    if max(len(r.prompt_ids) for r in requests) + params.max_new_tokens > ctx_len:
        raise ValueError(f"a prompt + {params.max_new_tokens} new tokens exceeds ctx_len {ctx_len}")


def _fixed_batches(items: list, workers: int, cap: int) -> list[list]:
    """The fixed rule: items in submission order, cut into the fewest near-equal batches of <= cap that
    keep every worker busy (a multiple of `workers` batches), batch j -> worker j % workers. It depends on
    the request count only; with batch-invariant ops the bits do not depend on it at all."""
    k = min(len(items), -(-max(1, -(-len(items) // cap)) // workers) * workers)
    bounds = [round(j * len(items) / k) for j in range(k + 1)]
    return [items[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _shutdown(procs, tasks, inbox) -> None:
    for q in tasks or [inbox] * len(procs):
        q.put(None)
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.terminate()
