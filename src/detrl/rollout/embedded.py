"""The embedded engine: worker processes, each one engine core (scheduler + paged KV pool) fed by a router.

Like SGLang with data-parallel replicas: `generate` routes whole prompt groups (a group's samples share its
prompt's KV blocks, so a group never splits across replicas) to `num_workers` worker processes (forked like
DataLoader workers, one intra-op thread each: on CPU a decode step is many small ops, and threads serialise on
the GIL). Each worker runs `scheduler.EngineCore`: continuous batching over its own paged KV pool, results sent
back the step a sequence finishes. Routing (determinism.routing): `fixed` gives worker j the j-th contiguous
run of groups, near-equal in requests, as one message (the worker's schedule is then a function of the
requests alone); `dynamic` is SGLang's shortest-queue dispatch: a group goes to the worker with the fewest
requests in flight, at most `max_batch_size` each, the rest wait in the router until results come back (the
composition follows the timing). The workers read the policy weights from shared memory that
`update_weights` overwrites in place; their KV pools are freed at each update and rebuilt at the next call.
`scheduler="static"` runs the previous engine (`rollout.static`) instead: the benchmark's baseline.
"""

from __future__ import annotations

import os
import queue
import sys
import traceback
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from detrl.models.forward import engine_copy
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.batching import SCHEDULERS, check_fits, fixed_batches, fixed_group_routing, prompt_groups
from detrl.rollout.paged import PoolSpec, kv_token_bytes
from detrl.rollout.scheduler import EngineCore
from detrl.rollout.static import POLL_S, Sampler, serve_static
from detrl.rollout.weight_views import copy_into

CPU_POOL = PoolSpec()  # the engine's own pool knobs when none are given (a run passes its config's)


def _free_bytes(workers: int) -> int | None:
    """Each worker's share of the memory free now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // workers
    except (ValueError, OSError):
        return None


def _serve_core(worker: int, core: EngineCore, own, outbox, abort, parent: int, deterministic: bool) -> None:
    """A worker process: add what the router sends, step the core while it holds work, send what finishes."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(
        deterministic
    )  # determinism.torch_algorithms, as in the engine's process
    torch.utils.deterministic.fill_uninitialized_memory = False
    current, stop = 0, False  # the newest call seen (call ids increase)

    def handle(msg) -> None:
        nonlocal current, stop
        if msg is None:
            stop = True
        elif msg[0] == "release":
            core.release()
        else:
            _, call, stream_seed, params, items = msg
            if call > current:  # a new call: this worker's stream restarts from the engine's draw
                core.generator.manual_seed((stream_seed + worker) % 2**63)
                current = call
            for i, r in items:
                core.add((call, i), r, params)

    while not stop:
        if core.idle():
            while True:
                try:
                    handle(own.get(timeout=POLL_S))
                    break
                except queue.Empty:
                    if os.getppid() != parent:
                        os._exit(0)
        while not stop:
            try:
                handle(own.get_nowait())
            except queue.Empty:
                break
        if stop or core.idle():
            continue
        try:
            finished = core.abort() if abort.is_set() else core.step()
        except Exception:  # noqa: BLE001 - the engine raises it
            outbox.put((current, worker, "error", {}, traceback.format_exc()))
            core.abort()
            continue
        by_call: dict = {}
        for f in finished:
            by_call.setdefault(f.key[0], []).append(
                (f.key[1], f.tokens, f.logprobs, f.finish_reason, f.routed_experts)
            )
        for call, payload in by_call.items():
            outbox.put((call, worker, "batch", core.stats(), payload))


class EmbeddedEngine:
    """Holds its own copy of the policy weights (synced by `update_weights`, as a serving engine would).

    The worker processes start at the first `generate` and stop at `close` (or when the engine is
    collected, or at exit). `params` is the default sampling of a call; `generate` takes its own.
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
        scheduler: str = "continuous",
        pool: PoolSpec = CPU_POOL,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers}: need at least 1")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={scheduler!r}: choose one of {', '.join(SCHEDULERS)}")
        self.config = model.config
        self.ops, self.ctx_len, self.params = ops, ctx_len, params
        self.num_workers, self.max_batch_size, self.fixed_routing = num_workers, max_batch_size, fixed_routing
        self.batch_window_s, self.scheduler = batch_window_s, scheduler
        self.block_size, self.prefill_chunk = pool.block_size, pool.prefill_chunk
        # per worker; the bound (half the free memory) holds for an explicit size too; float32's bytes per token
        self.blocks = pool.blocks(
            _free_bytes(num_workers), kv_token_bytes(model.config, 4), ctx_len, max_batch_size
        )
        self.deterministic = torch.are_deterministic_algorithms_enabled()  # set by determinism.setup
        # the weights the workers read: shared memory, overwritten in place at each sync
        # in the compute dtype (ops.dtype: bf16 copies of float32 masters), as the trainer's forward fuses them
        # (an FSDP2-sharded model: empty, filled by the caller's streaming weight sync)
        self.weights = engine_copy(model, ops.dtype, "cpu", share=True)
        self.generator = torch.Generator().manual_seed(seed)  # the engine's stream (requests without a seed)
        self._ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
        self._abort = (
            self._ctx.Event()
        )  # set: running sequences stop at their next step, queued ones do not run
        self.sampler = Sampler(
            self.weights, ops, ctx_len, params, torch.Generator().manual_seed(seed), self._abort
        )
        self.batch_log: list[
            tuple[int, tuple[tuple[int, int], ...]]
        ] = []  # (worker, uids) per result message
        self.stats: dict[int, dict] = {}  # per worker: KV bytes at the peak, pool bytes, prefix-cache hits
        self._procs: list = []
        self._call = 0
        self._calls: dict[int, _Call] = {}  # submitted calls not yet read to the end
        self._load = [0] * num_workers  # dynamic routing: requests in flight per worker

    def update_weights(self, weights: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """A state dict, or (name, tensor) pairs (one at a time): each copied into its part of the shared fused
        weights in place (`weight_views.copy_into`: no second copy of the model).
        The workers' KV pools (and prefix caches) are released, rebuilt at the next call."""
        copy_into(self.weights, weights.items() if isinstance(weights, dict) else weights)
        if self.scheduler == "continuous":
            for q in self._queues if self._procs else []:
                q.put(("release",))

    def abort(self) -> None:
        """Cut the call in flight: running sequences return what they sampled, queued ones nothing ("abort")."""
        self._abort.set()

    def run_batch(self, requests: list[Request], params: SamplingParams | None = None) -> list[Result]:
        """One static batch in this process, in request order (the probe's direct path)."""
        self.sampler.params = params or self.params
        return self.sampler.run_batch(requests)

    def close(self) -> None:
        if self._procs:
            self._finalizer()
            self._procs = []

    def stat(self, key: str) -> int:
        """A worker statistic summed over the workers (each holds its own pool), e.g. kv_bytes_peak."""
        return sum(s.get(key, 0) for s in self.stats.values())

    def _start(self) -> None:
        if self._procs and all(p.is_alive() for p in self._procs):
            return
        self.close()
        self._outbox = self._ctx.Queue()
        static_dynamic = self.scheduler == "static" and not self.fixed_routing
        self._queues = [self._ctx.Queue() for _ in range(self.num_workers)]
        self._inbox = self._ctx.Queue() if static_dynamic else None
        for w in range(self.num_workers):
            self._procs.append(self._ctx.Process(target=self._target(), args=self._args(w), daemon=True))
            self._procs[-1].start()
        queues = [self._inbox] * self.num_workers if static_dynamic else self._queues
        self._finalizer = weakref.finalize(self, _shutdown, list(self._procs), queues)

    def _target(self):
        return _serve_core if self.scheduler == "continuous" else serve_static

    def _args(self, w: int) -> tuple:
        if self.scheduler == "continuous":
            core = EngineCore(
                self.weights, self.ops, self.ctx_len, self.blocks, self.block_size, self.prefill_chunk,
                self.max_batch_size, torch.Generator(),
            )  # fmt: skip
            return (w, core, self._queues[w], self._outbox, self._abort, os.getpid(), self.deterministic)
        sampler = Sampler(self.weights, self.ops, self.ctx_len, self.params, None, self._abort)
        tasks = self._queues[w] if self.fixed_routing else None
        return (w, sampler, tasks, self._inbox, self._outbox, self.max_batch_size, self.batch_window_s,
                os.getpid(), self.deterministic)  # fmt: skip

    def generate(
        self, requests: list[Request], params: SamplingParams | None = None, stop_when=None
    ) -> list[Result]:
        """All requests through the workers, sampled with `params` (None: the engine's). Fixed routing: results
        in request order; else completion order.

        `stop_when(results_so_far) -> bool` (dynamic routing only) is checked as results arrive; once true,
        running sequences are cut at their next step and queued requests come back unstarted, all with finish
        reason "abort" (an async system's cut of a partial rollout).
        """
        self.batch_log = []
        if not requests:
            return []
        if self.fixed_routing and stop_when is not None:
            raise ValueError("stop_when needs dynamic routing; with fixed routing cut by token budget")
        done = list(self.results(self.submit(requests, params), stop_when))
        if self.fixed_routing:
            by_uid = {r.uid: r for r in done}
            return [by_uid[r.uid] for r in requests]
        return done

    def submit(self, requests: list[Request], params: SamplingParams | None = None) -> int:
        """Start requests now, while other calls may still run (their sequences join the running batches);
        -> the call's id for `results`."""
        params = params or self.params
        check_fits(requests, params, self.ctx_len)
        if self.scheduler == "static" and self._calls:
            raise ValueError("rollout.scheduler=static runs one call at a time; submit needs continuous")
        if not self._calls:
            self._abort.clear()
            self._load = [0] * self.num_workers
        self._start()
        self._call += 1
        head = (self._call, int(torch.randint(0, 2**62, (1,), generator=self.generator)), params)
        backlog = self._route(list(enumerate(requests)), head)
        self._calls[self._call] = _Call(requests, head, backlog)
        return self._call

    def results(self, call: int, stop_when=None) -> Iterator[Result]:
        """A submitted call's results in completion order, as they arrive (see generate for stop_when)."""
        st, done = self._calls[call], []
        try:
            while len(done) < len(st.requests):
                while not st.inbox:
                    self._receive()
                worker, kind, payload = st.inbox.popleft()
                results = [Result(st.requests[i], *out) for i, *out in payload]
                if kind == "batch":
                    self.batch_log.append((worker, tuple(r.uid for r in results)))
                done += results
                yield from results
                if stop_when is not None and not self._abort.is_set() and stop_when(done):
                    self._abort.set()
                    cut = [Result(st.requests[i], [], [], "abort") for g in st.backlog or () for i, _ in g]
                    st.backlog = None if st.backlog is None else []
                    done += cut
                    yield from cut
        finally:
            del self._calls[call]

    def _route(self, indexed: list[tuple[int, Request]], head: tuple) -> list | None:
        """Send the call's requests to the workers; -> the groups the dynamic router holds back (else None)."""
        if self.scheduler == "static":
            if self.fixed_routing:
                batches = fixed_batches(indexed, self.num_workers, self.max_batch_size)
                for w, tasks in enumerate(self._queues):
                    tasks.put((*head, [(j, batches[j]) for j in range(w, len(batches), self.num_workers)]))
            else:  # requests arrive one prompt group at a time (at most a batch each)
                for g in prompt_groups(indexed, self.max_batch_size):
                    self._inbox.put((*head, g))
            return None
        groups = prompt_groups(indexed, self.max_batch_size)
        if self.fixed_routing:
            for w, share in enumerate(fixed_group_routing(groups, self.num_workers)):
                if share:
                    self._queues[w].put(("run", *head, share))
            return None
        backlog = list(reversed(groups))
        self._dispatch(backlog, head)
        return backlog

    def _dispatch(self, backlog: list, head: tuple) -> None:
        """Shortest queue first: groups to the worker with the fewest requests in flight, up to a batch each."""
        while backlog:
            w = min(range(self.num_workers), key=self._load.__getitem__)
            if self._load[w] and self._load[w] + len(backlog[-1]) > self.max_batch_size:
                return
            g = backlog.pop()
            self._load[w] += len(g)
            self._queues[w].put(("run", *head, g))

    def _receive(self) -> None:
        """The next result message from any worker, to its call's inbox (the router refills the worker first);
        a worker's error or death raises here."""
        while True:
            try:
                call, worker, kind, stats, payload = self._outbox.get(timeout=POLL_S)
            except queue.Empty:
                dead = [(w, p.exitcode) for w, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    self.close()
                    raise RuntimeError(f"rollout worker {dead[0][0]} exited (code {dead[0][1]})") from None
                continue
            if call not in self._calls:
                continue  # left over from a call that raised
            if kind == "error":
                raise RuntimeError(f"rollout worker {worker} failed:\n{payload}")
            self.stats[worker] = stats
            st = self._calls[call]
            if st.backlog is not None:
                self._load[worker] -= len(payload)
                for other in self._calls.values():
                    self._dispatch(other.backlog or [], other.head)
            st.inbox.append((worker, kind, payload))
            return


@dataclass
class _Call:
    """A submitted call: its requests, its routing head, the groups the router holds back, results not yet read."""

    requests: list[Request]
    head: tuple
    backlog: list | None
    inbox: deque = field(default_factory=deque)


def _shutdown(procs, queues) -> None:
    for q in queues:
        q.put(None)
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.terminate()
