"""Beyond one process: torchrun's env -> a process group, FSDP2 over the policy, rank helpers, gathers, and
how `update()` splits micro-batches over ranks and reduces their gradients (`DataParallel`).

    torchrun --nproc-per-node 2 train.py ...     # one trainer + one rollout engine per rank

A plain `python train.py` (or a single torchrun process) joins no process group and runs exactly the
single-process code (same bits as before this module existed). With WORLD_SIZE > 1:

- process group from torchrun's env (`env://`): `gloo` on a CPU-only machine, `cpu:gloo,cuda:nccl` when CUDA
  is there (CPU tensors, e.g. gathered rollouts, go over gloo; CUDA tensors over nccl);
- the policy and the reference model are FSDP2 modules (`fully_shard` per block, then the root; fp32
  reduction). detrl's functional forward reads the weights with `fuse(model)`, not through the module forward
  that FSDP2 hooks: on a sharded model it gathers the root group once per pass and each block inside its
  (checkpointed) layer, forward and again in the backward (`fsdp.Gather`); each block's backward hands its full
  gradient to `DataParallel.reduce_group`, which sends the shards to their owners, and `DataParallel.reduce`
  clips the sharded gradients the optimizer steps (AdamW on the shards);
- every rank holds the whole step batch (the gathered rollouts), so loss denominators are global by
  construction (verl's global batch info), and every rank computes the same advantages and metrics;
- only rank 0 logs (`detrl.tracking`) and writes run files; checkpoints use torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist

from detrl import fsdp

# What the code does with memory, for the planner (detrl.plan.Layout's fields; the rest as its TODAY): the
# functional forward gathers one block at a time (and the root group), forward and backward, its matrices in the
# compute dtype (fsdp.gather_cast; a tied embedding's root in fp32, not planned apart); the ordered
# reduce keeps an fp32 accumulator shard and one block's gradient with its all-to-all buffers; the weight sync
# passes one parameter at a time; the batch-invariant attention's backward (models/ops.py query_chunked on CPU,
# models/triton_attention.py attention_backward on CUDA) runs in pieces of ATTN_QUERY_CHUNK query rows
PLAN_LAYOUT = dict(
    gather="block", gather_dtype="compute", reduce="shard", sync="block", attn_backward="pieces"
)


def _from_slurm() -> None:
    """A SLURM task started without torchrun (e.g. Hydra's submitit launcher with tasks_per_node > 1): torchrun's
    variables from SLURM's (submitit's helper: rank = SLURM_PROCID, master = the job's first host)."""
    if "WORLD_SIZE" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def requested_world_size() -> int:
    _from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def backend() -> str:
    """nccl for CUDA tensors when CUDA is there (gloo still carries CPU objects), else gloo."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init() -> int:
    """Join torchrun's process group when WORLD_SIZE > 1 (idempotent) -> the world size."""
    if dist.is_initialized() or requested_world_size() <= 1:  # (SLURM tasks: torchrun's env from SLURM's)
        return world_size()
    if torch.cuda.is_available():  # one GPU per local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend())
    return world_size()


def trainer_threads(env: dict, cores: int, world: int, ordered: bool) -> int | None:
    """The intra-op thread count a rank must run at so that its bits are a plain process's (None: leave it).

    CPU results depend on the thread count (measured on 2 cores: at 16 threads MKL's gemm is no longer
    row-invariant and the self-check routes every linear through the tiled fallback: other bits). A plain
    `python train.py` runs at torch's default (every core, or the user's OMP_NUM_THREADS); torchrun starts each
    rank at OMP_NUM_THREADS=1 when none is set. Under the ordered reduce a rank runs at what a plain process
    would: the user's value, or every core where the value is torchrun's 1 (an explicit OMP_NUM_THREADS=1 reads
    the same: ranks then run at every core)."""
    if world <= 1 or not ordered:
        return None
    given = env.get("OMP_NUM_THREADS")
    return int(given) if given and given != "1" else cores


def pin_threads(ordered: bool) -> int:
    """Set this process's intra-op threads by `trainer_threads` (before any math) -> the count it runs at."""
    n = trainer_threads(dict(os.environ), len(os.sched_getaffinity(0)), world_size(), ordered)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run a block at n intra-op threads (None: as it is), then restore the count (a benchmark's peer at its best:
    on 2 cores small-op workloads such as transformers' `generate` run faster at one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def close() -> None:
    """Leave the process group, every rank together, after a last barrier whose work this process keeps: gloo's
    threads drop a work after wait() returns, and one whose last owner frees tensors then (a barrier weakly holds
    the collectives in flight when queued: FSDP2's gathers) needs the GIL, which a finalizing interpreter cannot
    give ("terminate called without an active exception", pytorch/pytorch#179291)."""
    if dist.is_initialized():
        work = dist.barrier(async_op=True)
        work.wait()
        close.kept = work  # to the end of the process
        dist.destroy_process_group()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """[rank 0's obj, rank 1's, ...] on every rank."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def store():
    """The job's key-value store (torchrun's rendezvous TCPStore): shared counters across ranks."""
    return dist.distributed_c10d._get_default_store()


@contextlib.contextmanager
def main_first():
    """Rank 0 runs the block first (e.g. builds and caches the warm start), then the others."""
    if world_size() > 1 and not is_main():
        dist.barrier()
    try:
        yield
    finally:
        if world_size() > 1 and is_main():
            dist.barrier()


def same_run_dir(run_dir: Path) -> Path:
    """Rank 0's run dir on every rank (Hydra names it by the second each process started)."""
    init()
    return Path(broadcast_object(str(run_dir)))


def check_supported(cfg) -> None:
    """What the multi-rank path does not cover yet: one line, before anything runs."""
    from detrl.config.base import ConfigError

    if world_size() == 1:
        return
    if cfg.rollout.partial.enabled:
        raise ConfigError("rollout.partial.enabled=true is single-process only for now; run without torchrun")
    if cfg.rollout.backend != "embedded":
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend!r} is single-process only for now; "
            "use rollout=embedded under torchrun"
        )


# --- FSDP2 (detrl.fsdp: per block, then the root) ---------------------------------------------------------

full_items, is_sharded = fsdp.full_items, fsdp.is_sharded


def shard(*models, compute: torch.dtype | None = None, ordered: bool = True) -> None:
    """FSDP2 over each model, block by block then the root (in place; None skipped). World size 1: nothing.
    compute: the compute dtype (gathered in it on GPUs under `off`); ordered: the ordered reduce (fp32 gathers)."""
    if world_size() == 1:
        return
    for m in models:
        if m is not None:
            fsdp.shard(m, compute, ordered)


def unshard(*models) -> None:
    """FSDP2 modules: every block's and the root's full parameters all-gathered (plain modules: nothing).
    Collective: every rank calls it the same number of times."""
    for m in models:
        if m is not None:
            fsdp.unshard(m)


def reshard(*models) -> None:
    """FSDP2 modules: back to the shards (the full parameters freed)."""
    for m in models:
        if m is not None:
            fsdp.reshard(m)


def sync_weights(model, engine) -> str:
    """The engine gets the policy's weights and -> `fp/params`, the same digest for any world size. One process:
    the state dict as it is. Sharded: one parameter gathered at a time, in the digest's (sorted) order, copied into
    the engine and hashed as it passes, then dropped: never the full model at once."""
    from detrl.fingerprint import StreamDigest, params_digest

    if not is_sharded(model):
        weights = model.state_dict()
        engine.update_weights(weights)
        return params_digest(weights)
    h = StreamDigest()
    engine.update_weights(h.pass_through(full_items(model)))
    return h.hexdigest()


def drift(run_dir: Path, step: int, model, results) -> dict[str, float]:
    """Rank 0 appends the step's drift sketches (`fingerprint.drift_step`) -> its metrics ({} elsewhere). Sharded:
    every rank gathers the parameters one at a time (collective), rank 0 folds them into the sketch."""
    from detrl.fingerprint import drift_step

    if not is_sharded(model):
        return drift_step(run_dir, step, model, results) if is_main() else {}
    params = fsdp.full_params(model)
    if not is_main():
        for _ in params:  # the gathers are collective: drained here
            pass
        return {}
    return drift_step(run_dir, step, model, results, tensors=params)


# --- the trainer's data parallelism --------------------------------------------------------------------------


def micro_batches(
    start: int, stop: int, mb: int, world: int, rank: int, ordered: bool
) -> list[tuple[tuple, slice]]:
    """Rank `rank`'s (key, rows) of the rows [start, stop). ordered: one process's micro-batches of `mb` rows,
    micro-batch k on rank k mod world (a rank may hold none); else a contiguous 1/world share per rank,
    micro-batched locally. Keys order the micro-batches globally."""
    if ordered:
        cuts = [((k,), slice(lo, min(lo + mb, stop))) for k, lo in enumerate(range(start, stop, mb))]
        return [c for c in cuts if c[0][0] % world == rank]
    n = stop - start
    lo, hi = start + n * rank // world, start + n * (rank + 1) // world
    return [((rank, k), slice(a, min(a + mb, hi))) for k, a in enumerate(range(lo, hi, mb))]


class DataParallel:
    """How `update()` spreads one mini-batch's micro-batches over ranks and reduces their gradients.

    world 1: every micro-batch here, autograd accumulates them, `clip_grad_norm_`: the single-process path.
    ordered (determinism=on, world W > 1): the mini-batch is cut into one process's micro-batches
      (`micro_batch_size` sequences, whatever W is), run in rounds of W: micro-batch k on rank k mod W. In each
      block's backward (`reduce_group`) an all-to-all sends shard j (FSDP2's dim-0 shard of every parameter) of
      each sender's gradient to rank j, which adds them to its fp32 accumulator in k order: g_0 + g_1 + ... is
      one process's accumulation, in the same order, so the gradient shards, the norm (each parameter's norm
      taken over its whole gradient, gathered one parameter at a time, as one process takes it) and the AdamW
      step are the same bits for any W. A rank with no micro-batch in a round, or none that trains a token,
      runs a backward of zeros on one row and sends nothing (`open_round`: the senders known before the
      forward; a round without any is skipped). Memory beyond one block's gradient: the accumulator (params / W)
      and one parameter's receive buffer; traffic: about a reduce-scatter's per round, plus one all-gather for
      the norm. Gradients are summed, not averaged, so the loss carries no dp_size.
    averaged (off, W > 1): verl / FSDP data parallelism: rank r trains a contiguous 1/W of each mini-batch in its
      own micro-batches, the loss is scaled by dp_size = W with the mini-batch's global denominators
      (verl's agg_loss global batch info), each block's gradient is reduce-scattered in its backward (summed,
      in whatever order the backend sums), divided by W and accumulated on the shards by autograd.
    """

    def __init__(self, model, ordered: bool):
        self.world, self.rank, self.ordered = world_size(), rank(), ordered
        self.sharded = list(model.parameters())  # FSDP2: the DTensor shards the optimizer holds
        self.loss_scale = self.world if (self.world > 1 and not ordered) else 1  # verl's dp_size
        self._acc: list[torch.Tensor | None] = [None] * len(self.sharded)  # ordered: this rank's grad shards
        self._index = {id(p): i for i, p in enumerate(self.sharded)}
        self._flags = [0] * self.world  # the round's senders (open_round)
        self._rows = [fsdp.shard_rows(p.shape[0], self.world) for p in self.sharded]

    def micro_batches(self, start: int, stop: int, mb: int) -> list[tuple[tuple, slice]]:
        """This rank's (key, rows) of the mini-batch rows [start, stop); keys order micro-batches globally."""
        return micro_batches(start, stop, mb, self.world, self.rank, self.ordered or self.world == 1)

    def rounds(self, start: int, stop: int, mb: int) -> list[tuple[tuple, slice] | None]:
        """This rank's (key, rows) of the mini-batch rows [start, stop), one per round; W > 1: every rank the
        same number of rounds (the passes' gathers are collective), None where it holds no micro-batch of one."""
        mine = self.micro_batches(start, stop, mb)
        if self.world == 1:
            return mine
        if self.ordered:
            n_rounds = -(-len(range(start, stop, mb)) // self.world)
        else:
            n_rounds = max(
                len(micro_batches(start, stop, mb, self.world, r, False)) for r in range(self.world)
            )
        return mine + [None] * (n_rounds - len(mine))

    def open_round(self, trains: bool, scores: bool = False) -> tuple[int, bool]:
        """Before a round's forward, on every rank (collective): whether this rank's micro-batch trains a token
        (a sender: its backward sends its gradient) and whether it needs a pass without training (scores) ->
        (senders, whether any rank scores). No sender: every rank skips the backward of the round."""
        if self.world == 1:
            return int(trains), scores
        flags = torch.zeros(2, self.world, dtype=torch.int32)
        flags[0, self.rank], flags[1, self.rank] = int(trains), int(scores)
        dist.all_reduce(flags)
        self._flags = [int(f) for f in flags[0]]
        return sum(self._flags), bool(flags[1].any())

    def reducing(self, model):
        """For the mini-batch: backwards through the sharded model's gathers reduce here (`reduce_group`)."""
        return fsdp.reducing(model, self)

    def reduce_group(self, params: list, grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """A gathered group's full gradients, in its backward (collective, every rank the same groups in the same
        order) -> each local shard's gradient. ordered: each parameter's shard j sent to rank j and added to its
        fp32 accumulator in sender (= micro-batch) order, None returned (autograd accumulates nothing); off: the
        reduce-scattered shard / W (autograd accumulates it across micro-batches into the DTensor's grad)."""
        out = []
        for p, g in zip(params, grads):
            i = self._index[id(p)]
            g = g.float().reshape(-1)
            if self.ordered:
                self._send(i, g)
                out.append(None)
            else:
                out.append(self._reduce_scatter(i, g).view(-1, *p.shape[1:]).to(p.dtype))
        return out

    def _send(self, i: int, g: torch.Tensor) -> None:
        """Ordered: shard j of parameter i's full gradient g (this round's) to rank j, from senders only; the
        received parts added to this rank's accumulator in rank order (the first one cloned)."""
        flags, mine = self._flags, self._numel(i, self.rank)
        trained, senders = flags[self.rank], sum(flags)
        recv = torch.empty(mine * senders, device=g.device)
        dist.all_to_all_single(
            recv,
            g if trained else g[:0],  # dim-0 shards are contiguous: rank j's is the j-th run of elements
            output_split_sizes=[mine * f for f in flags],
            input_split_sizes=[self._numel(i, j) * trained for j in range(self.world)],
        )
        for part in recv.view(senders, mine):  # senders in rank order = micro-batch order
            if self._acc[i] is None:
                self._acc[i] = part.clone()
            else:
                self._acc[i] += part

    def gather_rows(self, tensors: list[torch.Tensor | None], mine: list[slice]) -> list[torch.Tensor | None]:
        """Rows each rank computed (its `mine` slices), assembled on every rank (a copy: the same bits)."""
        if self.world == 1:
            return tensors
        owners = all_gather_object([(s.start, s.stop) for s in mine])
        out = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            parts = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(parts, t.contiguous())
            full = t.clone()
            for r, spans in enumerate(owners):
                for lo, hi in spans:
                    full[lo:hi] = parts[r][lo:hi]
            out.append(full)
        return out

    def gather_records(self, records: list[tuple[tuple, dict]]) -> list[dict]:
        """Per-micro-batch metric records of all ranks, in global micro-batch order."""
        if self.world == 1:
            return [r for _, r in records]
        return [r for _, r in sorted(x for rs in all_gather_object(records) for x in rs)]

    def reduce(self, model, max_norm: float) -> float:
        """After the mini-batch's backwards: this rank's gradient shards (the ordered accumulator, or off the
        reduce-scattered grads autograd accumulated), clipped by the whole gradient's norm -> the norm."""
        if self.world == 1:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        if self.ordered:
            flat, self._acc = self._acc, [None] * len(self.sharded)
            if flat[0] is None:  # no token in the mini-batch: no gradient (as one process: grads stay None)
                for p in self.sharded:
                    p.grad = None
                return 0.0
        else:
            flat = [
                torch.zeros(self._numel(i, self.rank)) if p.grad is None else p.grad.to_local()
                for i, p in enumerate(self.sharded)
            ]
        local = [g.reshape(-1, *p.shape[1:]) for g, p in zip(flat, self.sharded)]
        total = self._norm(local)
        torch._foreach_mul_(local, torch.clamp(max_norm / (total + 1e-6), max=1.0))  # clip_grad_norm_'s own
        from torch.distributed.tensor import DTensor

        for p, g in zip(self.sharded, local):
            p.grad = DTensor.from_local(
                g.to(p.dtype), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return float(total)

    def _reduce_scatter(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """off: this rank's shard of parameter i's (flat) gradient summed over ranks, / W (padded to equal
        shards)."""
        pad = self._numel(i, 0)
        out = torch.empty(pad, device=g.device)
        dist.reduce_scatter_tensor(out, torch.nn.functional.pad(g, (0, pad * self.world - g.numel())))
        return out[: self._numel(i, self.rank)] / self.world

    def _norm(self, local: list[torch.Tensor]) -> torch.Tensor:
        """The gradient's 2-norm as one process's clip_grad_norm_ takes it: each parameter's norm over its whole
        gradient (ordered: gathered one parameter at a time), then the norm of those norms. off: from the
        shards' sums of squares."""
        if not self.ordered:
            sq = torch.stack([g.pow(2).sum() for g in local]).sum()
            dist.all_reduce(sq)
            return sq.sqrt()
        norms = []
        for i, (g, p) in enumerate(zip(local, self.sharded)):
            pad = self._numel(i, 0)
            parts = [torch.empty(pad, device=g.device) for _ in range(self.world)]
            dist.all_gather(parts, torch.nn.functional.pad(g.reshape(-1), (0, pad - g.numel())))
            full = torch.cat([t[: self._numel(i, r)] for r, t in enumerate(parts)]).view(p.shape).to(p.dtype)
            norms.extend(torch._foreach_norm([full], 2.0))  # clip_grad_norm_'s per-tensor norm
            del full, parts
        return torch.linalg.vector_norm(torch.stack(norms), 2.0)

    def _numel(self, i: int, r: int) -> int:
        """Elements of parameter i's shard on rank r (FSDP2: dim 0 cut in ceil(d0 / W)-row chunks)."""
        lo, hi = self._rows[i][r]
        return (hi - lo) * math.prod(self.sharded[i].shape[1:])
