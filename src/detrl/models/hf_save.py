"""A Hugging Face checkpoint written one tensor at a time: what `save_pretrained` writes (config, generation config,
`model.safetensors` or `model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, the tied lm_head left out,
Qwen3-MoE's fused experts split back into per-expert `gate_proj` / `up_proj` / `down_proj` as transformers saves them)
from (name, tensor) pairs, holding at most one file's tensors (`max_shard_bytes`) instead of the whole state dict.
A sharded run streams its gathered parameters through it (`fsdp.full_items`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

MAX_SHARD_BYTES = (
    5 * 2**30
)  # transformers' default max_shard_size ("5GB" in its GiB-less sense is close enough)
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_pairs(name: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) for one state-dict entry: per-expert tensors for the fused MoE experts
    (gate_up_proj [E, 2I, H] -> experts.e.gate_proj / up_proj [I, H]; down_proj [E, H, I] -> experts.e.down_proj)."""
    m = _FUSED.match(name)
    if m is None:
        yield name, t
        return
    base, kind = m.groups()
    for e in range(t.shape[0]):
        if kind == "down_proj":
            yield f"{base}.{e}.down_proj.weight", t[e]
        else:
            gate, up = t[e].chunk(2, dim=0)
            yield f"{base}.{e}.gate_proj.weight", gate
            yield f"{base}.{e}.up_proj.weight", up


def write_pretrained(
    directory: Path, model, items: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = MAX_SHARD_BYTES
) -> list[Path]:
    """`model`'s config (and generation config) and the tensors of `items` as a Hugging Face checkpoint in
    `directory` -> the weight files written. `items`: the state dict's (name, tensor) pairs, in any order."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    files, shard, size, total = [], {}, 0, 0

    def flush():
        nonlocal shard, size
        if shard:
            part = directory / f".part-{len(files):05d}.safetensors"
            save_file(shard, str(part), metadata={"format": "pt"})
            files.append((part, list(shard)))
            shard, size = {}, 0

    for name, t in items:
        if tied and name == "lm_head.weight":
            continue
        for key, x in hf_pairs(name, t):
            nbytes = x.numel() * x.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
            shard[key] = x.detach().to("cpu").contiguous().clone()
            size, total = size + nbytes, total + nbytes
    flush()
    return _name_files(directory, files, total)


def _name_files(directory: Path, files: list[tuple[Path, list[str]]], total: int) -> list[Path]:
    """The parts renamed as transformers names them; an index when there are several."""
    if len(files) == 1:
        final = directory / "model.safetensors"
        os.replace(files[0][0], final)
        return [final]
    out, weight_map = [], {}
    for k, (part, names) in enumerate(files, start=1):
        final = directory / f"model-{k:05d}-of-{len(files):05d}.safetensors"
        os.replace(part, final)
        out.append(final)
        weight_map.update(dict.fromkeys(names, final.name))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def save_model(directory: Path, model) -> None:
    """As `model.save_pretrained(directory)`; an FSDP2-sharded model gathered one parameter at a time and written
    by rank 0 (`write_pretrained`: never the whole state dict on any rank). Collective when sharded."""
    from detrl import fsdp

    if not fsdp.is_sharded(model):
        model.save_pretrained(directory)
        return
    import torch.distributed as dist

    items = fsdp.full_items(model)
    if dist.get_rank() == 0:
        write_pretrained(directory, model, items)
    else:
        for _ in items:  # the gathers are collective: drained here
            pass
