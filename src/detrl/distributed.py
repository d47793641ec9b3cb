"""Beyond one process: torchrun's env -> a process group, FSDP2 over the policy, rank helpers, gathers, and
how `update()` splits micro-batches over ranks and reduces their gradients (`DataParallel`).

    torchrun --nproc-per-node 2 train.py ...     # one trainer + one rollout engine per rank

A plain `python train.py` (or a single torchrun process) joins no process group and runs exactly the
single-process code (same bits as before this module existed). With WORLD_SIZE > 1:

- process group from torchrun's env (`env://`): `gloo` on a CPU-only machine, `cpu:gloo,cuda:nccl` when CUDA
  is there (CPU tensors, e.g. gathered rollouts, go over gloo; CUDA tensors over nccl);
- the policy and the reference model are FSDP2 modules (`fully_shard`, one parameter group each, mixed
  precision = the parameters' dtype with fp32 reduction). detrl's functional forward reads the weights with
  `fuse(model)`, not through the module forward that FSDP2 hooks, so `unsharded(...)` all-gathers them
  explicitly around each pass and reshards after; gradients land on the unsharded parameters and
  `DataParallel.reduce` turns them into the sharded gradients the optimizer steps (AdamW on the shards);
- every rank holds the whole step batch (the gathered rollouts), so loss denominators are global by
  construction (verl's global batch info), and every rank computes the same advantages and metrics;
- only rank 0 logs (`detrl.tracking`) and writes run files; checkpoints use torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
import torch.distributed as dist


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


def close() -> None:
    if dist.is_initialized():
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
    from detrl.config import ConfigError

    if world_size() == 1:
        return
    if cfg.rollout.partial.enabled:
        raise ConfigError("rollout.partial.enabled=true is single-process only for now; run without torchrun")
    if cfg.rollout.backend != "embedded":
        raise ConfigError(
            f"rollout.backend={cfg.rollout.backend!r} is single-process only for now; "
            "use rollout=embedded under torchrun"
        )


# --- FSDP2 ------------------------------------------------------------------------------------------------

_MESH = None


def _mesh(device: torch.device):
    global _MESH
    if _MESH is None or _MESH.device_type != device.type:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = init_device_mesh(device.type, (world_size(),))
    return _MESH


def shard(*models) -> None:
    """FSDP2 over each model (in place; None skipped). World size 1: nothing (plain modules)."""
    if world_size() == 1:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for m in models:
        if m is None:
            continue
        p = next(m.parameters())
        fully_shard(
            m,
            mesh=_mesh(p.device),
            mp_policy=MixedPrecisionPolicy(param_dtype=p.dtype, reduce_dtype=torch.float32),
        )


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unshard(*models) -> None:
    """FSDP2 modules: the full parameters all-gathered and registered on the modules (plain modules: nothing).
    Collective: every rank calls it the same number of times."""
    for m in models:
        if m is not None and is_sharded(m):
            m.unshard()


def reshard(*models) -> None:
    """FSDP2 modules: back to the shards (the full parameters freed)."""
    for m in models:
        if m is not None and is_sharded(m):
            m.reshard()


@contextlib.contextmanager
def unsharded(*models):
    """`unshard` for the block, `reshard` after."""
    unshard(*models)
    try:
        yield
    finally:
        reshard(*models)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole state dict on every rank (DTensors all-gathered; the same names and bits as unsharded)."""
    sd = model.state_dict()
    if not is_sharded(model):
        return sd
    from torch.distributed.tensor import DTensor

    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd.items()}


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
    ordered (determinism=on, world W > 1): the mini-batch is cut into the same virtual micro-batches as on one
      process (`micro_batch_size` sequences, whatever W is); micro-batch k runs on rank k mod W. Each
      micro-batch's gradient is kept apart (fp32), all are all-gathered, and every rank sums them in k order:
      g_0 + g_1 + ... is what one process's accumulation computes, in the same order, so the gradient, its norm
      (taken over the full gradient, as one process does) and the AdamW step on the shards are the same bits for
      any W. Gradients are summed, not averaged, so the loss carries no dp_size. Cost: each rank receives every
      micro-batch's gradient (K x params), not one reduced copy; parallelism = micro-batches per mini-batch.
    averaged (off, W > 1): verl / FSDP data parallelism: rank r trains a contiguous 1/W of each mini-batch in its
      own micro-batches, the loss is scaled by dp_size = W with the mini-batch's global denominators
      (verl's agg_loss global batch info), gradients are all-reduced (summed, in whatever order the backend
      sums) and divided by W.
    """

    def __init__(self, model, ordered: bool):
        self.world, self.rank, self.ordered = world_size(), rank(), ordered
        self.sharded = list(model.parameters())  # FSDP2: the DTensor shards the optimizer holds
        self.loss_scale = self.world if (self.world > 1 and not ordered) else 1  # verl's dp_size
        self._stash: list[tuple[tuple, torch.Tensor]] = []

    def micro_batches(self, start: int, stop: int, mb: int) -> list[tuple[tuple, slice]]:
        """This rank's (key, rows) of the mini-batch rows [start, stop); keys order micro-batches globally."""
        return micro_batches(start, stop, mb, self.world, self.rank, self.ordered or self.world == 1)

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

    def after_backward(self, model, key: tuple) -> None:
        """ordered: set this micro-batch's gradient apart (the next backward starts from none)."""
        if self.world == 1 or not self.ordered:
            return
        params = list(model.parameters())  # the unsharded ones (between `unshard` and `reshard`)
        self._stash.append((key, _flat_grads(params)))
        for p in params:
            p.grad = None

    def reduce(self, model, max_norm: float) -> float:
        """After the mini-batch's backwards, the model still unsharded: the sharded gradients, clipped -> norm."""
        if self.world == 1:
            return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        live = list(model.parameters())
        if self.ordered:
            stash, self._stash = self._stash, []
            keys = all_gather_object([k for k, _ in stash])
            kmax = max(len(ks) for ks in keys)
            if kmax == 0:  # no token in the mini-batch: no gradient (as one process: grads stay None)
                for p in self.sharded:
                    p.grad = None
                return 0.0
            size = sum(p.numel() for p in live)
            local = torch.zeros(kmax, size, device=live[0].device)
            for i, (_, g) in enumerate(stash):
                local[i] = g
            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local)
            order = sorted((k, r, i) for r, ks in enumerate(keys) for i, k in enumerate(ks))
            flat = parts[order[0][1]][order[0][2]].clone()
            for _, r, i in order[1:]:  # global micro-batch order: one process's accumulation order
                flat += parts[r][i]
        else:
            flat = _flat_grads(live)
            dist.all_reduce(flat)
            flat /= self.world
        for p in live:
            p.grad = None
        full = [g.view_as(p).to(p.dtype) for g, p in zip(flat.split([p.numel() for p in live]), live)]
        # clip_grad_norm_'s own two halves, on the full gradient (its norm as one process takes it)
        total = torch.nn.utils.get_total_norm(full, 2.0)
        torch._foreach_mul_(full, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        from torch.distributed.tensor import distribute_tensor

        for p, g in zip(self.sharded, full):  # this rank's shard of each (a local slice, no communication)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)
        return float(total)


def _flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params]
    )
