"""A model.path checkpoint built sharded (issue 29): no rank ever holds the whole fp32 model.

    model = load_sharded(path, device, ordered=True)   # under torchrun, W > 1

The Hugging Face class is built from the checkpoint's config on the meta device, sharded by `fsdp.shard` (per block,
then the root: FSDP2's dim-0 shards, torch.chunk's cut), given empty storage on the run's device (`to_empty`), and
each parameter's local shard is filled from the checkpoint's safetensors: `safe_open(...).get_slice(name)[lo:hi]`, so
a rank reads only its rows of each tensor (`Reader.read` counts them). What the file holds is cast to float32 as
`from_pretrained(dtype=float32)` casts it. Handled:
- the tied lm_head (absent from the file under config.tie_word_embeddings): one parameter with the embedding;
- Qwen3-MoE's fused experts (transformers 5: `mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) from the
  file's per-expert `experts.{e}.gate_proj / up_proj / down_proj.weight` (what `hf_save` and save_pretrained write;
  gate_up = cat(gate, up), as transformers' MergeModulelist + Concatenate): a rank's dim-0 shard is a range of
  experts, and it reads only those experts' tensors (a file holding the fused names is sliced as it is);
- the rotary modules' non-persistent buffers (the only buffers of Qwen3 / Qwen3-MoE) (`inv_freq`, `original_inv_freq`): recomputed as transformers' own
  `_init_weights` computes them for a from_pretrained model (the same bits).
A tensor the file lacks, or of another shape than the model's, is a one-line `ShardLoadError` naming it and its file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from detrl.config.base import ConfigError
from detrl.models.hf_save import _FUSED  # the fused experts' names: hf_save splits them, here they are joined


class ShardLoadError(ConfigError):
    """The checkpoint cannot fill the model: a tensor missing, or of another shape (one line naming both)."""


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (model.safetensors, or the index's weight map)."""
    p = Path(path)
    if (p / "model.safetensors").is_file():
        from safetensors import safe_open

        with safe_open(str(p / "model.safetensors"), framework="pt") as f:
            return dict.fromkeys(f.keys(), p / "model.safetensors")
    index = p / "model.safetensors.index.json"
    if index.is_file():
        return {k: p / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    raise ShardLoadError(
        f"model.path={str(path)!r}: a sharded load (torchrun) reads safetensors; found neither "
        "model.safetensors nor model.safetensors.index.json (re-save with save_pretrained, or run on one rank)"
    )


class Reader:
    """A checkpoint's tensors read by dim-0 row range, each file opened once; `read` counts the elements returned
    (what a rank read of the file)."""

    def __init__(self, path: str | Path):
        self.path, self.files = Path(path), tensor_files(path)
        self._open: dict[Path, object] = {}
        self.read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _slice(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def rows(self, name: str, lo: int, hi: int, want: tuple[int, ...]) -> torch.Tensor:
        """Rows [lo, hi) of tensor `name`, whose whole shape must be `want`; cast to float32."""
        if name not in self.files:
            raise ShardLoadError(
                f"tensor {name!r} is not in {self.where()} (the model needs it; the file has {len(self.files)})"
            )
        got = self.shape(name)
        if got != tuple(want):
            raise ShardLoadError(
                f"tensor {name!r} in {self.files[name]} has shape {list(got)}; the model's is {list(want)}"
            )
        t = self._slice(name)[lo:hi]
        self.read += t.numel()
        return t.to(torch.float32)

    def where(self) -> str:
        index = self.path / "model.safetensors.index.json"
        return str(index if index.is_file() else self.path / "model.safetensors")


def expert_rows(reader: Reader, base: str, kind: str, lo: int, hi: int, shape) -> torch.Tensor:
    """Experts [lo, hi) of a fused parameter (`kind` gate_up_proj [E, 2I, H] or down_proj [E, H, I]) from the
    file's per-expert tensors."""
    if kind == "down_proj":
        parts = [reader.rows(f"{base}.{e}.down_proj.weight", 0, shape[1], shape[1:]) for e in range(lo, hi)]
    else:
        half = (shape[1] // 2, shape[2])
        parts = [
            torch.cat(
                [reader.rows(f"{base}.{e}.{w}.weight", 0, half[0], half) for w in ("gate_proj", "up_proj")]
            )
            for e in range(lo, hi)
        ]
    return torch.stack(parts) if parts else torch.empty(0, *shape[1:])


def tensor_rows(reader: Reader, name: str, shape, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the model's parameter `name` (whole shape `shape`) as from_pretrained(float32) loads it."""
    shape = tuple(shape)
    m = _FUSED.match(name)
    if m is not None and name not in reader:
        return expert_rows(reader, *m.groups(), lo, hi, shape)
    if hi <= lo:  # a trailing rank's empty shard: nothing to read (the name is still checked)
        reader.rows(name, 0, 0, shape)
        return torch.empty(0, *shape[1:])
    return reader.rows(name, lo, hi, shape)


def shard_of(reader: Reader, name: str, shape, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 shard (torch.chunk's cut, as FSDP2's Shard(0)) of parameter `name`."""
    from detrl.fsdp import shard_rows

    lo, hi = shard_rows(shape[0], world)[rank]
    return tensor_rows(reader, name, shape, lo, hi)


def meta_model(path: str | Path, attn_implementation: str | None = None) -> torch.nn.Module:
    """The checkpoint's Hugging Face class on the meta device, float32, with the config (and generation config)
    from_pretrained gives it; no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    config = AutoConfig.from_pretrained(str(path), local_files_only=True, **kwargs)
    config.name_or_path = str(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return model


def rotary_buffers(module) -> torch.Tensor:
    """A rotary module's inv_freq as transformers' `_init_weights` computes it (from_pretrained's bits)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fns = {"default": getattr(module, "compute_default_rope_parameters", None), **ROPE_INIT_FUNCTIONS}
    if fns.get(module.rope_type) is None:
        raise ShardLoadError(
            f"rope_type={module.rope_type!r} of {type(module).__name__}: no init function (choices: "
            f"{', '.join(k for k, v in fns.items() if v is not None)})"
        )
    return fns[module.rope_type](module.config)[0]


def fill_buffers(model: torch.nn.Module, reader: Reader) -> None:
    """Every buffer after `to_empty`: the rotary ones recomputed (Qwen3 and Qwen3-MoE have no other); any other
    is refused in one line."""
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if "RotaryEmbedding" in type(module).__name__ and name in ("inv_freq", "original_inv_freq"):
                buf.copy_(rotary_buffers(module))
            else:
                raise ShardLoadError(
                    f"buffer {mod_name}.{name!s} of {type(module).__name__}: sharded loading cannot fill it from "
                    f"{reader.where()} (known: rotary inv_freq, original_inv_freq)"
                )


def fill_one(name: str, p: torch.Tensor, shard: torch.Tensor, rank: int, where: str) -> None:
    """Parameter `name`'s local shard (FSDP2's, or the whole tensor unsharded) set to `shard`, in place."""
    local = p.to_local() if hasattr(p, "to_local") else p
    if shard.shape != local.shape:
        raise ShardLoadError(
            f"tensor {name!r}: rank {rank}'s shard of {where} is {list(shard.shape)}, FSDP2's is {list(local.shape)}"
        )
    local.copy_(shard)


def fill_params(model: torch.nn.Module, reader: Reader, rank: int, world: int) -> None:
    """Each parameter's local shard (a tied one once) filled from the file, in place."""
    for name, p in model.named_parameters():
        fill_one(name, p, shard_of(reader, name, p.shape, rank, world), rank, reader.where())


def load_sharded(
    path: str | Path,
    device: torch.device,
    ordered: bool = True,
    compute: torch.dtype | None = None,
    attn_implementation: str | None = None,
) -> torch.nn.Module:
    """The checkpoint's model, FSDP2-sharded over the default group (`fsdp.shard`), each rank's shards read from
    the file: in eval mode, float32, as from_pretrained(dtype=float32) then `fsdp.shard` leaves it. Not collective
    in the reads (each rank opens the files itself)."""
    import torch.distributed as dist

    from detrl import fsdp

    model = meta_model(path, attn_implementation)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    fsdp.shard(model, compute, ordered, device=device)
    model.to_empty(device=device)
    if tied and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise ShardLoadError(f"model.path={str(path)!r}: the tied lm_head lost its tie when sharded")
    reader = Reader(path)
    with torch.no_grad():
        fill_params(model, reader, dist.get_rank(), dist.get_world_size())
        fill_buffers(model, reader)
    return model.eval()
