"""A random init built sharded (model.init=random under torchrun, W > 1): no rank ever holds the whole model, and
each rank's shards hold the bits `build_model(cfg, seed)` then `fsdp.shard` gives (the 1-rank run's model).

    model = init_sharded(cfg.model, seed, device, ordered=True)

The Hugging Face class is constructed on the meta device under `Recorder`, a dispatch mode that records every
write to a tensor in order (torch's `reset_parameters` of each Linear / Embedding as it is built: kaiming_uniform_,
normal_, the padding row's fill_; then transformers' `_init_weights`: normal_, ones_, the padding row's zero_, the
MoE experts' and router's normal_; then the tie of lm_head to the embedding), with the views they write through
(`weight[padding_idx]`). On meta these draw nothing. transformers skips `_init_weights` for a model built on meta
(`init_weights` asks `get_torch_context_manager_or_global_device`): it is told "cpu" while recording, so that the
meta build runs the CPU build's code, tie included.

`replay` then runs the recorded writes in order on CPU with the RNG seeded as build_model seeds it (under
fork_rng): each parameter's writes from its last whole overwrite (normal_, uniform_, fill_, zero_ of the whole
tensor) on a temporary full tensor, materialised one at a time and freed once its last write is done, after its
rank's rows (`sharded_load.shard_of`, torch.chunk's cut as FSDP2's Shard(0)) are copied into the sharded parameter;
every earlier random write (torch's default init, since overwritten; the untied lm_head's own weight, dropped by
the tie) drawn into a scratch tensor of the same shape and strides, so that the stream advances exactly as in the
full build. Peak extra memory: about one parameter. The rotary buffers (the only buffers) are recomputed as
`sharded_load.fill_buffers` does (transformers' `_init_weights` copies the same values into them).

Refused in one line (`ShardInitError`): a write reading another tensor (a copy, a tie made by copying), a random
op not writing a tensor (a random factory), an explicit generator, a parameter never wholly overwritten (its bits
would come from its construction), a parameter read by a computation, a random write to a buffer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detrl.config.base import ConfigError

if TYPE_CHECKING:
    from detrl.config import ModelConfig

aten = torch.ops.aten
# writes that set every element of the tensor they are applied to (whatever it held)
WHOLE = {
    aten.normal_.default,
    aten.uniform_.default,
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.log_normal_.default,
    aten.cauchy_.default,
    aten.geometric_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
}


class ShardInitError(ConfigError):
    """The random init cannot be replayed shard by shard (one line naming the op and the tensor)."""


@dataclass(frozen=True)
class Write:
    """One recorded in-place op: on the tensor `root` (its id) through the view ops `chain`, func(target, *args)."""

    root: int
    chain: tuple
    func: object
    args: tuple
    kwargs: dict
    reads: bool  # it takes another tensor (a copy_ source)

    @property
    def seeded(self) -> bool:
        return torch.Tag.nondeterministic_seeded in self.func.tags

    @property
    def whole(self) -> bool:
        return not self.chain and not self.reads and self.func in WHOLE


def _tensors(xs) -> list[torch.Tensor]:
    return [x for x in xs if isinstance(x, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Records the writes to tensors in order (`writes`), the views they go through, and which tensors are read by
    a computation (`read`); keeps every tensor it names alive, so that ids stay unique."""

    def __init__(self):
        super().__init__()
        self.writes: list[Write] = []
        self.views: dict[int, tuple[int, tuple]] = {}  # id(view) -> (root id, chain of view ops)
        self.tensors: dict[int, torch.Tensor] = {}
        self.read: dict[int, str] = {}  # root id -> the first op that read it

    def root_of(self, t: torch.Tensor) -> tuple[int, tuple]:
        self.tensors[id(t)] = t
        return self.views.get(id(t), (id(t), ()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kwargs.get("generator") is not None:
            raise ShardInitError(
                f"{func} with an explicit generator: the sharded random init replays the default one"
            )
        schema = func._schema
        written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if written:
            self.note_write(func, args, kwargs, written)
        elif (
            schema.returns
            and schema.returns[0].alias_info is not None
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            self.note_view(func, args, kwargs, out)
        elif torch.Tag.nondeterministic_seeded in func.tags:
            raise ShardInitError(
                f"{func}: a random op writing no tensor; the sharded random init cannot replay it"
            )
        else:
            for t in _tensors([*args, *kwargs.values()]):
                self.read.setdefault(self.root_of(t)[0], str(func))
        return out

    def note_write(self, func, args, kwargs, written) -> None:
        if written[0].name != "self" or len(written) > 1 or not isinstance(args[0], torch.Tensor):
            raise ShardInitError(
                f"{func}: writes {[a.name for a in written]}; only an in-place op on self replays"
            )
        root, chain = self.root_of(args[0])
        reads = bool(_tensors([*args[1:], *kwargs.values()]))
        self.writes.append(Write(root, chain, func, tuple(args[1:]), dict(kwargs), reads))

    def note_view(self, func, args, kwargs, out) -> None:
        root, chain = self.root_of(args[0])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, v in enumerate(outs):
            if isinstance(v, torch.Tensor):
                self.tensors[id(v)] = v
                self.views[id(v)] = (root, (*chain, (func, tuple(args[1:]), dict(kwargs), i)))


def _through(t: torch.Tensor, chain: tuple) -> torch.Tensor:
    """The view of `t` the recorded chain of view ops leads to."""
    for func, args, kwargs, i in chain:
        out = func(t, *args, **kwargs)
        t = out[i] if isinstance(out, (tuple, list)) else out
    return t


@dataclass
class Plan:
    """The recorded writes resolved against the built model: parameter names (canonical: a tied one once), the root
    tensors (meta: shapes, strides, dtypes), and each parameter's last whole overwrite (its live writes start
    there)."""

    writes: list[Write]
    tensors: dict[int, torch.Tensor]
    names: dict[int, str]  # root id -> parameter name
    start: dict[str, int]  # parameter -> index of its last whole write
    end: dict[str, int]  # parameter -> index of its last write

    def scratch(self, root: int) -> torch.Tensor:
        t = self.tensors[root]
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)


def resolve(rec: Recorder, model: torch.nn.Module) -> Plan:
    """`rec`'s writes against `model`'s parameters and buffers; refuses what cannot be replayed (see the module)."""
    names = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    start, end = {}, {}
    for i, w in enumerate(rec.writes):
        name = names.get(w.root)
        if name is None:
            if w.root in buffers and w.seeded:
                raise ShardInitError(f"{w.func} on buffer {buffers[w.root]}: a random buffer is not replayed")
            continue
        if w.reads:
            raise ShardInitError(f"{w.func} on {name} reads another tensor (a copy or a tie): not replayable")
        if w.whole:
            start[name] = i
        end[name] = i
    for pid, name in names.items():
        if name not in start:
            raise ShardInitError(
                f"parameter {name}: never wholly overwritten by an init op; its bits are unknown"
            )
        if pid in rec.read:
            raise ShardInitError(
                f"parameter {name} is read by {rec.read[pid]} during the init: not replayable"
            )
    return Plan(rec.writes, rec.tensors, names, start, end)


@contextlib.contextmanager
def recording():
    """A meta build running the CPU build's init code (transformers' `init_weights` skips it on meta), recorded."""
    from transformers import modeling_utils

    rec = Recorder()
    with (
        mock.patch.object(modeling_utils, "get_torch_context_manager_or_global_device", lambda: None),
        torch.device("meta"),
        rec,
    ):
        yield rec


def meta_random(cfg: ModelConfig) -> tuple[torch.nn.Module, Plan]:
    """build_model's class and config on the meta device (float32, as its `.float()` leaves it), and its init."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    from detrl.models.build import hf_config

    cls = Qwen3ForCausalLM if cfg.name == "qwen3" else Qwen3MoeForCausalLM
    with recording() as rec:
        model = cls(hf_config(cfg))
    plan = resolve(rec, model)
    return model.float(), plan


class Rows:
    """One full tensor served as `sharded_load.Reader` serves a file's (`shard_of` reads its rows)."""

    def __init__(self, name: str, full: torch.Tensor):
        self.name, self.full, self.read = name, full, 0

    def __contains__(self, name: str) -> bool:
        return name == self.name

    def rows(self, name: str, lo: int, hi: int, want) -> torch.Tensor:
        if tuple(self.full.shape) != tuple(want):
            raise ShardInitError(
                f"{name}: the init's tensor is {list(self.full.shape)}, the model's {list(want)}"
            )
        self.read += hi - lo
        return self.full[lo:hi].to(torch.float32)

    def where(self) -> str:
        return "the seed's random init"


def replay(plan: Plan, params: dict[str, torch.Tensor], seed: int, rank: int, world: int) -> int:
    """The recorded writes on CPU from `torch.manual_seed(seed)` (under fork_rng); each parameter's rank-`rank`
    rows of W=`world` copied into `params[name]` (its local shard, or the whole tensor at W=1) once its last
    write is done. At most one full parameter (plus one scratch) is alive at a time, where writes do not
    interleave (Qwen3's do not). -> the most elements of full parameters alive at once."""
    from detrl.models.sharded_load import fill_one, shard_of

    live: dict[str, torch.Tensor] = {}
    peak = 0
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for i, w in enumerate(plan.writes):
            name = plan.names.get(w.root)
            if name is None or i < plan.start[name]:  # dead: only its draws matter
                if w.seeded:
                    w.func(_through(plan.scratch(w.root), w.chain), *w.args, **w.kwargs)
                continue
            if i == plan.start[name]:
                live[name] = plan.scratch(w.root)
                peak = max(peak, sum(t.numel() for t in live.values()))
            w.func(_through(live[name], w.chain), *w.args, **w.kwargs)
            if i == plan.end[name]:
                full = live.pop(name)
                shard = shard_of(Rows(name, full), name, full.shape, rank, world)
                fill_one(name, params[name], shard, rank, "the random init")
    return peak


def init_sharded(
    cfg: ModelConfig,
    seed: int,
    device: torch.device,
    ordered: bool = True,
    compute: torch.dtype | None = None,
) -> torch.nn.Module:
    """`build_model(cfg, seed)`'s model FSDP2-sharded over the default group (`fsdp.shard`, as `load_sharded`),
    each rank materialising only its own rows: the same bits as the full build then sharded. Not collective
    beyond fsdp.shard."""
    import torch.distributed as dist

    from detrl import fsdp
    from detrl.models.sharded_load import fill_buffers

    model, plan = meta_random(cfg)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    fsdp.shard(model, compute, ordered, device=device)
    model.to_empty(device=device)
    if tied and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise ShardInitError("model.tie_word_embeddings: the tied lm_head lost its tie when sharded")
    params = dict(model.named_parameters())
    if set(params) != set(plan.start):
        raise ShardInitError(
            f"the sharded model's parameters differ from the init's: {sorted(set(params) ^ set(plan.start))}"
        )
    replay(plan, params, seed, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        fill_buffers(model, Rows("", torch.empty(0)))
    return model
