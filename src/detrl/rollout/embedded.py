"""The embedded engine: concurrent in-process workers, each batching the requests routed to it.

Like a serving engine with several replicas and dynamic batching: `generate` routes requests to
`num_workers` threads; each runs a KV-cache sampler over the functional Qwen3 forward on batches of up
to `max_batch_size` requests. With `fixed_routing` (determinism on) a request's worker is a function of
its uid and each worker batches its share in submission order. Without it (off) requests arrive one
prompt group at a time on a shared queue, a free worker takes whatever is queued (first free, dynamic
batch composition), and results come back in completion order.
"""

from __future__ import annotations

import copy
import queue
import threading

import torch

from detrl.models.forward import KVCache, forward, rope_tables, token_logprobs
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.sampling import hashed_gumbel, sample, stream_gumbel

_DONE = None


def worker_of(request: Request, num_workers: int) -> int:
    """The fixed routing rule: a stable function of the uid."""
    return (request.prompt_uid * 1_000_003 + request.sample_index) % num_workers


class EmbeddedEngine:
    """Holds its own copy of the policy weights (synced by `update_weights`, as a serving engine would)."""

    def __init__(self, model: torch.nn.Module, ops: Ops, ctx_len: int, params: SamplingParams, seed: int,
                 num_workers: int = 1, max_batch_size: int = 64, fixed_routing: bool = True):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ops, self.ctx_len, self.params = ops, ctx_len, params
        self.num_workers, self.max_batch_size, self.fixed_routing = num_workers, max_batch_size, fixed_routing
        self.rope = rope_tables(self.model.config, ctx_len)
        self.generator = torch.Generator().manual_seed(seed)  # the shared stream (requests without a seed)
        self.batch_log: list[tuple[int, tuple[tuple[int, int], ...]]] = []  # (worker, uids) per batch run

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    def close(self) -> None:
        pass

    def generate(self, requests: list[Request]) -> list[Result]:
        """All requests through the workers. Fixed routing: results in request order; else completion order."""
        self.batch_log = []
        if not requests:
            return []
        if self.fixed_routing:
            return self._generate_fixed(requests)
        return self._generate_dynamic(requests)

    def _generate_fixed(self, requests: list[Request]) -> list[Result]:
        shards: list[list[Request]] = [[] for _ in range(self.num_workers)]
        for r in requests:
            shards[worker_of(r, self.num_workers)].append(r)

        def work(w: int) -> list[Result]:
            out = []
            for lo in range(0, len(shards[w]), self.max_batch_size):
                out += self._logged_batch(w, shards[w][lo : lo + self.max_batch_size])
            return out

        by_uid = {res.uid: res for shard in _run_threads(work, self.num_workers) for res in shard}
        return [by_uid[r.uid] for r in requests]

    def _generate_dynamic(self, requests: list[Request]) -> list[Result]:
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
                while len(batch) < self.max_batch_size:  # whatever has arrived, up to a full batch
                    try:
                        nxt = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is _DONE:
                        inbox.put(_DONE)
                        break
                    batch.append(nxt)
                results = self._logged_batch(w, batch)
                with lock:
                    done.extend(results)  # completion order

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
        """Sample a response for each request of one engine batch, in request order."""
        p = self.params
        b = len(requests)
        lens = torch.tensor([len(r.prompt_ids) for r in requests])  # [B]
        if int(lens.max()) + p.max_new_tokens > self.ctx_len:
            raise ValueError(f"prompt of {int(lens.max())} tokens + {p.max_new_tokens} new > ctx_len {self.ctx_len}")
        prompts = torch.zeros(b, int(lens.max()), dtype=torch.long)  # right-padded [B, P]
        for i, r in enumerate(requests):
            prompts[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        seeded = [r.seed is not None for r in requests]
        if any(seeded) and not all(seeded):
            raise ValueError("a batch mixes seeded and unseeded requests")
        seeds = torch.tensor([r.seed for r in requests]) if all(seeded) else None
        stops = torch.tensor(p.stop_token_ids or (-1,))

        cache = KVCache.empty(self.model, b, self.ctx_len)
        logits = forward(self.model, prompts, self.ops, self.ctx_len, self.rope, cache=cache)  # [B, P, V]
        last = logits[torch.arange(b), lens - 1]  # [B, V]
        pos = lens.clone()  # position of the token being sampled, per row
        tokens, logps = [], []
        done = torch.zeros(b, dtype=torch.bool)
        finished_at = torch.full((b,), p.max_new_tokens)
        for t in range(p.max_new_tokens):
            _, logp = token_logprobs(last, torch.zeros(b, dtype=torch.long), p.temperature)  # [B, V]
            vocab = logp.shape[-1]
            noise = hashed_gumbel(seeds, pos, vocab) if seeds is not None else stream_gumbel(self.generator, b, vocab)
            tok = sample(logp, noise, p.top_p)  # [B]
            tokens.append(tok)
            logps.append(logp.gather(-1, tok[:, None]).squeeze(-1))
            hit = torch.isin(tok, stops) & ~done
            finished_at[hit] = t + 1
            done |= hit
            if bool(done.all()) or t == p.max_new_tokens - 1:
                break
            last = forward(self.model, tok[:, None], self.ops, self.ctx_len, self.rope, cache=cache,
                           positions=pos[:, None])[:, 0]
            pos = pos + 1
        tok_mat, lp_mat = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist()  # [B, T]
        out = []
        for i, r in enumerate(requests):
            n = int(finished_at[i])
            out.append(Result(r, tok_mat[i][:n], lp_mat[i][:n], "stop" if bool(done[i]) else "length"))
        return out


def _run_threads(fn, n: int) -> list:
    """fn(i) for i in range(n) on n threads; re-raises the first worker error."""
    results: list = [None] * n
    errors: list[BaseException] = []

    def target(i: int) -> None:
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
