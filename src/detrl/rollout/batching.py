"""The batching rules every engine shares: what fits, how requests group, the fixed routing of groups."""

from __future__ import annotations

from detrl.rollout.base import Request, SamplingParams

SCHEDULERS = ("continuous", "static")  # rollout.scheduler


def check_fits(requests: list[Request], params: SamplingParams, ctx_len: int) -> None:
    """One line naming the longest prompt when a prompt + the new tokens cannot fit the context."""
    longest = max(len(r.prompt_ids) for r in requests)
    if longest + params.max_new_tokens > ctx_len:
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceeds ctx_len={ctx_len}"
        )


def fixed_batches(items: list, workers: int, cap: int) -> list[list]:
    """The fixed rule: items in submission order, cut into the fewest near-equal batches of <= cap that
    keep every worker busy (a multiple of `workers` batches), batch j -> worker j % workers. It depends on
    the request count only; with batch-invariant ops the bits do not depend on it at all."""
    k = min(len(items), -(-max(1, -(-len(items) // cap)) // workers) * workers)
    bounds = [round(j * len(items) / k) for j in range(k + 1)]
    return [items[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def prompt_groups(items: list[tuple[int, Request]], cap: int) -> list[list[tuple[int, Request]]]:
    """(index, request) pairs cut where the prompt changes (consecutive samples of one prompt), at most cap each:
    the unit a router hands to one replica, so a group's samples share its prompt's KV blocks there."""
    groups: list[list[tuple[int, Request]]] = []
    for i, r in items:
        if not groups or r.prompt_uid != groups[-1][-1][1].prompt_uid or len(groups[-1]) == cap:
            groups.append([])
        groups[-1].append((i, r))
    return groups


def fixed_group_routing(groups: list[list], workers: int) -> list[list]:
    """The fixed rule for schedulers: contiguous runs of whole groups, near-equal in requests, run j -> worker j.
    It depends on the group sizes only (not on timing); each worker's share arrives as one message."""
    total = sum(map(len, groups))
    out: list[list] = [[] for _ in range(workers)]
    seen = 0
    for g in groups:
        out[min(workers - 1, seen * workers // max(total, 1))].extend(g)
        seen += len(g)
    return out
