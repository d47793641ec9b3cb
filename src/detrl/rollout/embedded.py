"""The embedded engine: an in-process sampler with a KV cache over the functional Qwen3 forward."""

from __future__ import annotations

import copy

import torch

from detrl.models.forward import KVCache, forward, rope_tables, token_logprobs
from detrl.models.ops import Ops
from detrl.rollout.base import Request, Result, SamplingParams
from detrl.rollout.sampling import hashed_gumbel, sample, stream_gumbel


class EmbeddedEngine:
    """Holds its own copy of the policy weights (synced by `update_weights`, as a serving engine would)."""

    def __init__(self, model: torch.nn.Module, ops: Ops, ctx_len: int, params: SamplingParams, seed: int):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.ops, self.ctx_len, self.params = ops, ctx_len, params
        self.rope = rope_tables(self.model.config, ctx_len)
        self.generator = torch.Generator().manual_seed(seed)  # the shared stream (requests without a seed)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, requests: list[Request]) -> list[Result]:
        """Sample a response for each request; results come back in request order."""
        if not requests:
            return []
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
