"""The embedded engine on a GPU: one in-process replica, static shapes, decode steps as CUDA graphs.

Same interface and routing semantics as `rollout.embedded.EmbeddedEngine` (`generate / update_weights /
close`, `generator`, `batch_log`), on one device:
- weights: the engine's own copy of the fused weights in the compute dtype, on the device;
  `update_weights` copies the trainer's tensors into it on the device (no host round trip);
- batches: fixed routing (determinism.routing=fixed) cuts the requests, in submission order, into the fewest
  near-equal batches of <= max_batch_size and returns results in submission order; dynamic routing
  fills batches with prompt groups in arrival order and returns each batch's results in completion
  order (rows that stopped earlier first), as a continuous-batching server does;
- a batch runs at the next bucket size (powers of two; extra rows are idle and never returned) with a
  static KV cache [bucket, Hkv, ctx_len, D] per layer; the prefill runs eagerly, each decode step
  (sample from the last logits, record, forward the new token) is one replay of a CUDA graph captured
  once per (bucket, sampling mode); sampling draws Gumbel noise for one step [B, V] at a time (seeded:
  the hash of (seed, position, vocab id); unseeded: the device's generator, reseeded per call from the
  engine's stream); the host reads the stop flag every `sync_every` tokens and the tokens once at the end.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import torch

from detrl.models.forward import (
    KVCache,
    engine_copy,
    fuse,
    layer_post,
    layer_pre,
    log_probs,
    rope_tables,
    write_slots,
)
from detrl.models.forward import forward as model_forward
from detrl.models.ops import Ops, moe_dispatch
from detrl.rollout.base import Request, Result, SamplingParams, cut_results
from detrl.rollout.batching import check_fits, fixed_batches
from detrl.rollout.sampling import gumbel, hashed_gumbel, sample, seed_key
from detrl.rollout.weight_views import copy_into


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class _Slot:
    """The static buffers of one bucket size, and its captured decode steps per sampling mode."""

    cache: KVCache
    last: torch.Tensor  # [B, V] logits of the last position
    pos: torch.Tensor  # [B] position of the token being sampled
    t: torch.Tensor  # [1] step index
    key: torch.Tensor  # [B] seed keys (seeded sampling)
    limit: torch.Tensor  # [B] tokens allowed per row this call
    stops: torch.Tensor  # [S] stop token ids (or [1] = -1)
    stopped: torch.Tensor  # [B] sampled a stop token
    done: torch.Tensor  # [] every row finished
    tokens: torch.Tensor  # [B, T]
    logps: torch.Tensor  # [B, T]
    graphs: dict


def _unsharded_class(model) -> type:
    """The model's own class (FSDP2 swaps a sharded module's class for an FSDP subclass of it)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


class CudaEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        ops: Ops,
        ctx_len: int,
        params: SamplingParams,
        seed: int,
        max_batch_size: int = 256,
        fixed_routing: bool = True,
        device: torch.device | str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        graphs: bool = True,
        sync_every: int = 16,
        compile: bool = False,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self.ops = dataclasses.replace(ops, dtype=None, checkpoint=False)  # the weights are cast already
        self.ctx_len, self.params = ctx_len, params
        self.max_batch_size, self.fixed_routing, self.sync_every = max_batch_size, fixed_routing, sync_every
        self.config = model.config
        with torch.device("meta"):  # a weightless twin: a state dict is fused through it, on its own device
            self._twin = _unsharded_class(model)(model.config)
        # torchrun: a sharded model gives shapes only; empty, filled by the caller's streaming sync (pairs)
        self.weights = engine_copy(model, dtype, self.device)
        self.rope = rope_tables(self.config, ctx_len, self.device, dtype)
        # graphs need a dispatch without host syncs (the per-expert loop syncs: MoE on it runs eagerly)
        moe = getattr(self.config, "num_experts", None)
        self.graphs = graphs and not (moe and self.ops.moe is moe_dispatch)
        # torch.compile fuses a decode step's ~40 small kernels per layer into a few (launches dominate a step);
        # the runtime decides (detrl.runtime: with torch's kernels on CUDA, never with the batch-invariant ops,
        # whose bits must stay the trainer's eager ones)
        # each compiled function specialises per bucket and sampling mode: let dynamo keep them all (its default
        # limit of 8 sent the 9th shape back to eager with a warning: the probe's batch sizes 1..24 hit it)
        buckets = _bucket(max_batch_size).bit_length()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * buckets)
        # compiled: the sampling step and each layer's two halves (one compiled function serves every layer);
        # the cache writes between them run as they are, in place
        if compile:
            self._sample = torch.compile(_sample_step, dynamic=False)
            self._stages = (torch.compile(layer_pre, dynamic=False), torch.compile(layer_post, dynamic=False))
        else:  # the logprobs stay eager (the trainer's bits); the draw from them is compiled on CUDA either way
            draw = torch.compile(_draw, dynamic=False) if self.device.type == "cuda" else _draw
            self._sample, self._stages = functools.partial(_sample_step, draw=draw), (layer_pre, layer_post)
        self.generator = torch.Generator().manual_seed(seed)  # the engine's stream (requests without a seed)
        self.batch_log: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        self._slots: dict[int, _Slot] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None

    # --- weights
    def update_weights(
        self, state_dict: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Copy the trainer's weights (any device, any dtype) into the engine's, on the device. (name, tensor)
        pairs (a sharded model's streaming sync): each copied into its part of the fused weights in place."""
        if not isinstance(state_dict, dict):
            copy_into(self.weights, state_dict)
            return
        with torch.no_grad():
            self._twin.load_state_dict(state_dict, assign=True, strict=False)
            self.weights.copy_(fuse(self._twin))
            self._twin.to_empty(device="meta")  # hold no reference to the trainer's tensors

    def close(self) -> None:
        self._slots.clear()

    # --- generation
    def generate(
        self, requests: list[Request], params: SamplingParams | None = None, stop_when=None
    ) -> list[Result]:
        """As EmbeddedEngine.generate; `params` (None: the engine's) for this call only."""
        default, self.params = self.params, params or self.params
        try:
            return self._generate(requests, stop_when)
        finally:
            self.params = default

    def abort(self) -> None:
        """A single-device call runs to the end of its batch; nothing to cut between batches."""

    def _generate(self, requests: list[Request], stop_when=None) -> list[Result]:
        self.batch_log = []
        if not requests:
            return []
        if self.fixed_routing and stop_when is not None:
            raise ValueError("stop_when needs dynamic routing; with fixed routing cut by token budget")
        check_fits(requests, self.params, self.ctx_len)
        stream_seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        torch.cuda.manual_seed(stream_seed)  # this call's draws for unseeded requests (graphs replay from it)
        indexed = list(enumerate(requests))
        if self.fixed_routing:
            batches = fixed_batches(indexed, 1, self.max_batch_size)
        else:  # prompt groups in arrival order, as many as fit a batch
            batches = []
            for i, r in indexed:
                new_group = not batches or r.prompt_uid != batches[-1][-1][1].prompt_uid
                if (
                    not batches
                    or len(batches[-1]) == self.max_batch_size
                    or (new_group and len(batches[-1]) + self._group_size(requests, i) > self.max_batch_size)
                ):
                    batches.append([])
                batches[-1].append((i, r))
        done: list[Result] = []
        for j, items in enumerate(batches):
            if stop_when is not None and stop_when(done):
                done += [Result(r, [], [], "abort") for _, r in (x for b in batches[j:] for x in b)]
                break
            results = self.run_batch([r for _, r in items])
            self.batch_log.append((0, tuple(r.uid for r in results)))
            if not self.fixed_routing:  # completion order: the rows that stopped first come back first
                results = sorted(results, key=lambda r: len(r.tokens))
            done += results
        if self.fixed_routing:
            by_uid = {r.uid: r for r in done}
            return [by_uid[r.uid] for r in requests]
        return done

    @staticmethod
    def _group_size(requests: list[Request], i: int) -> int:
        n = 0
        while i + n < len(requests) and requests[i + n].prompt_uid == requests[i].prompt_uid:
            n += 1
        return n

    @torch.no_grad()
    def run_batch(self, requests: list[Request]) -> list[Result]:
        """One batch, in request order (see EmbeddedEngine's Sampler.run_batch for the semantics)."""
        p, dev = self.params, self.device
        b = len(requests)
        ctxs = [r.prompt_ids + r.prefix for r in requests]
        room = [p.max_new_tokens - len(r.prefix) for r in requests]
        limit = [
            min(m, r.max_new_tokens) if r.max_new_tokens is not None else m for m, r in zip(room, requests)
        ]
        seeded = [r.seed is not None for r in requests]
        if any(seeded) and not all(seeded):
            raise ValueError("a batch mixes seeded and unseeded requests")
        bb = _bucket(b)
        s = self._slot(bb)
        plen = max(len(c) for c in ctxs)
        prompts = torch.zeros(bb, plen, dtype=torch.long)  # right-padded [B, P]; idle rows: token 0
        for i, c in enumerate(ctxs):
            prompts[i, : len(c)] = torch.tensor(c)
        lens = torch.ones(bb, dtype=torch.long)
        lens[:b] = torch.tensor([len(c) for c in ctxs])
        limits = torch.zeros(bb, dtype=torch.long)
        limits[:b] = torch.tensor(limit)
        prompts, lens = prompts.to(dev, non_blocking=True), lens.to(dev, non_blocking=True)
        s.limit.copy_(limits, non_blocking=True)
        if all(seeded):
            seeds = torch.zeros(bb, dtype=torch.long)
            seeds[:b] = torch.tensor([r.seed for r in requests])
            s.key.copy_(seed_key(seeds.to(dev)))
        stops = torch.tensor(p.stop_token_ids or (-1,), dtype=torch.long)
        s.stops.fill_(-1)
        s.stops[: len(stops)].copy_(stops)
        s.last.copy_(
            model_forward(
                self.weights, prompts, self.ops, self.ctx_len, self.rope, cache=s.cache, last=lens - 1
            )
        )
        s.pos.copy_(lens)
        s.t.zero_()
        s.stopped.zero_()
        s.done.zero_()
        steps = max(limit)
        step = self._step_fn(s, all(seeded), p)
        mode = (all(seeded), p)
        if self.graphs and mode not in s.graphs:
            s.graphs[mode] = self._capture(s, step)
        run = s.graphs[mode].replay if self.graphs else step
        sampled = 0
        for t in range(steps):
            run()
            sampled = t + 1
            if sampled % self.sync_every == 0 and sampled < steps and bool(s.done):
                break
        tok_mat, lp_mat = s.tokens[:b, :sampled].tolist(), s.logps[:b, :sampled].tolist()  # one copy out
        return cut_results(requests, tok_mat, lp_mat, limit, room, p.stop_token_ids)

    def _step_fn(self, s: _Slot, seeded: bool, p: SamplingParams):
        """One decode step on the slot's static buffers: sample from s.last, record, forward the token."""

        def step() -> None:
            tok = self._sample(
                p.temperature,
                p.top_p,
                seeded,
                s.last,
                s.pos,
                s.t,
                s.key,
                s.limit,
                s.stops,
                s.stopped,
                s.done,
                s.tokens,
                s.logps,
            )
            s.last.copy_(
                model_forward(
                    self.weights,
                    tok[:, None],
                    self.ops,
                    self.ctx_len,
                    self.rope,
                    cache=s.cache,
                    positions=s.pos[:, None],
                    stages=self._stages,
                )[:, 0]
            )
            s.pos.add_(1).clamp_(max=self.ctx_len - 1)  # idle rows never pass the cache's end

        return step

    def _capture(self, s: _Slot, step) -> torch.cuda.CUDAGraph:
        """Capture one decode step. Its warm-up steps draw from CUDA's stream: the stream is put back after, so a
        call that captures samples what the same call replaying an earlier capture would."""
        saved = [x.clone() for x in (s.last, s.pos, s.t, s.stopped, s.done)]
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy inits, cached keys, allocator
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        for x, v in zip((s.last, s.pos, s.t, s.stopped, s.done), saved):
            x.copy_(v)
        torch.cuda.set_rng_state(rng, self.device)
        return graph

    def _slot(self, bb: int) -> _Slot:
        if bb not in self._slots:
            dev, c = self.device, self.config
            z = dict(device=dev)
            self._slots[bb] = _Slot(
                cache=KVCache.empty(c, bb, self.ctx_len, self.dtype, dev),
                last=torch.zeros(bb, c.vocab_size, dtype=self.dtype, **z),
                pos=torch.zeros(bb, dtype=torch.long, **z),
                t=torch.zeros(1, dtype=torch.long, **z),
                key=torch.zeros(bb, dtype=torch.long, **z),
                limit=torch.zeros(bb, dtype=torch.long, **z),
                stops=torch.full((max(1, len(self.params.stop_token_ids)),), -1, dtype=torch.long, **z),
                stopped=torch.zeros(bb, dtype=torch.bool, **z),
                done=torch.zeros((), dtype=torch.bool, **z),
                tokens=torch.zeros(bb, self.params.max_new_tokens, dtype=torch.long, **z),
                logps=torch.zeros(bb, self.params.max_new_tokens, dtype=torch.float32, **z),
                graphs={},
            )
        return self._slots[bb]


def _draw(logp: torch.Tensor, pos, key, seeded: bool, top_p: float) -> torch.Tensor:
    """The token each row samples from logp [B, V]: Gumbel-max with hashed (seeded) or stream noise, compiled (one
    fused kernel instead of ~20 over [B, V]); the recorded logprobs are not computed here. At top_p 1 (the
    default) it is exact integer hashing, elementwise float64 and an argmax: the same compiled code gives the same
    draws run to run. top_p < 1 adds a float32 exp / cumsum whose compiled bits are unproven against eager's or
    across buckets (repeats of a run still compile the same kernels)."""
    if seeded:
        noise = hashed_gumbel(None, pos, logp.shape[-1], key=key)  # [B, V] float64
    else:
        noise = gumbel(torch.rand(logp.shape, device=logp.device, dtype=torch.float64).clamp_min(1e-300))
    return sample(logp, noise, top_p)  # [B]


def _sample_step(
    temperature: float,
    top_p: float,
    seeded: bool,
    last,
    pos,
    t,
    key,
    limit,
    stops,
    stopped,
    done,
    tokens,
    logps,
    draw=_draw,
) -> torch.Tensor:
    """Sample the token at `pos` from `last` [B, V], record it and its logprob at column t, update the stop
    flags. Every tensor argument is a static buffer, updated in place (graph-capturable, no host sync)."""
    logp = log_probs(last, temperature)  # [B, V] float32
    tok = draw(logp, pos, key, seeded, top_p)  # [B]
    col = t.clamp(max=tokens.shape[1] - 1).expand(tok.shape[0], 1)
    write_slots(tokens, 1, col, tok[:, None])
    write_slots(logps, 1, col, logp.gather(-1, tok[:, None]))
    stopped.logical_or_(torch.isin(tok, stops))
    t.add_(1)
    done.copy_((stopped | (limit <= t)).all())
    return tok
