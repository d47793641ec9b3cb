"""Per-token logprobs (and entropy) of whole sequences without a [N, L, V] tensor.

The trainer needs log softmax(logits / T) at the sampled token of each response position only. Instead of
the full logits [N, L, V] (plus log_softmax, exp for the entropy and their gradients, all [N, L, V] fp32)
this runs the trunk once (`forward(..., head=False)` -> [N, L, H]), keeps the response rows [M, H], and
applies the lm_head + log_softmax to chunks of at most `chunk` rows ([chunk, V] at a time). With autograd,
each chunk is checkpointed: the backward recomputes its [chunk, V] logits instead of keeping them.

Bits: the lm_head row, `forward.log_probs` and the gather are per-row operations, so under batch-invariant
ops a token's logprob is the same bits as the sampler's (which applies them to [B, V] decode rows) and as
the unchunked [N, L, V] path's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from detrl.algos.core import entropy_from_logp
from detrl.models.forward import Weights, forward, fuse, log_probs

CHUNK_ELEMENTS = 2**24  # logits per chunk (64 MiB of fp32)
_ROWS = 16  # chunk sizes are multiples of this (the batch-invariant gemm's row tile)


def default_chunk(vocab: int) -> int:
    return max(_ROWS, CHUNK_ELEMENTS // vocab // _ROWS * _ROWS)


def _head(
    rows: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, linear, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = log_probs(linear(rows, w), temperature)  # [c, V]
    tok = logp.gather(-1, targets[:, None]).squeeze(-1)  # [c]
    ent = entropy_from_logp(logp) if entropy else tok.new_zeros(0)
    return tok, ent


def head_logprobs(
    rows: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    linear,
    temperature: float,
    entropy: bool = False,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [M, H] (final-normed hidden states), lm_head w [V, H], targets [M] -> logprob [M], entropy [M] or None."""
    c = chunk or default_chunk(w.shape[0])
    grad = torch.is_grad_enabled() and (rows.requires_grad or w.requires_grad)
    toks, ents = [], []
    for lo in range(0, rows.shape[0], c):
        args = (rows[lo : lo + c], w, targets[lo : lo + c], linear, temperature, entropy)
        tok, ent = checkpoint(_head, *args, use_reentrant=False) if grad else _head(*args)
        toks.append(tok)
        ents.append(ent)
    if not toks:
        return rows.new_zeros(0), (rows.new_zeros(0) if entropy else None)
    return torch.cat(toks), (torch.cat(ents) if entropy else None)


def sequence_logprobs(
    model,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    ops,
    ctx_len: int,
    rope,
    temperature: float,
    entropy: bool = False,
    chunk: int | None = None,
    experts: torch.Tensor | None = None,
    routes: bool = False,
):
    """Logprob of each next token where `mask` [N, L-1] is nonzero (0 elsewhere) -> [N, L-1], and its
    distribution's entropy [N, L-1] when asked. input_ids [N, L], left-aligned, L = ctx_len.

    MoE routing replay: experts [N, L-1, layers, k] the expert ids position j uses (aligned with mask: the
    routing of the pass that scores token j+1; -1: the router's own). routes=True adds a third value, the
    router's own choice [N, L-1, layers, k] (None for a dense model)."""
    weights = model if isinstance(model, Weights) else fuse(model, ops.dtype)  # compute-dtype copies on GPUs
    if experts is not None:  # the last position scores nothing: its own routing
        experts = F.pad(experts, (0, 0, 0, 0, 0, 1), value=-1)  # [N, L, layers, k]
    hidden = forward(weights, input_ids, ops, ctx_len, rope, head=False, experts=experts, routes=routes)
    if routes:
        hidden, chosen = hidden
    hidden = hidden[:, :-1]  # [N, L-1, H]
    w = weights.lm_head
    idx = mask.reshape(-1).nonzero().squeeze(-1)  # [M] flat positions of the scored tokens
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, idx)  # [M, H]
    targets = input_ids[:, 1:].reshape(-1).index_select(0, idx)  # [M]
    tok, ent = head_logprobs(rows, w, targets, ops.linear, temperature, entropy, chunk)

    def place(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(mask.numel()).index_copy(0, idx, x).view(mask.shape)

    out = place(tok), (place(ent) if entropy else None)
    return (*out, None if chosen is None else chosen[:, :-1]) if routes else out
