"""Streaming conversion: the converted checkpoint written from the source's own files.

The surgery leaves every pretrained tensor as it is and only adds heads, so a converted checkpoint
is the source's shards (hard-linked when source and output share a filesystem, else copied; cast
tensor by tensor for ``--dtype``) plus one shard of heads, tied together by an index. The model is
only built on the meta device: memory is bounded by the largest tensor, never the model.

Reuse is only correct where the files hold the tensors under the names the model has in memory;
families whose checkpoints transformers remaps on load (MoE experts stored one by one, renamed
heads) are converted in memory instead (``plan_stream`` says why).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import head_tensors
from ..errors import DeltafyError
from ..recipe import Recipe
from ..sources.folders import size
from ..sources.load import NO_REMOTE_CODE, load_config, resolve_dtype, source_tokenizer
from ..sources.provenance import local_provenance
from ..sources.shards import INDEX_FILE, Entry, read_header, read_tensor, weight_files, write_file
from ..surgery import convert

CHUNK = 16 << 20  # bytes per read when a shard is copied rather than linked
LINK_FAILURES = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.EOPNOTSUPP)

Progress = Callable[[int], None]  # called with the bytes just written


@dataclass
class StreamPlan:
    """What a streaming conversion writes, read from the source's config and file headers alone."""

    folder: Path
    model: nn.Module  # the converted skeleton: pretrained weights on meta, real heads
    files: list[Path]  # the source's shards, symlinks resolved
    entries: dict[str, Entry]  # key in the files -> where its bytes lie
    names: dict[str, str]  # the model's state-dict name -> its key in the files (heads: the key they get)
    cast: torch.dtype | None  # --dtype: floating tensors of another dtype are cast, one at a time
    tokenizer: object | None = None
    provenance: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of pretrained tensors the output holds."""
        return sum(self._size(e) for e in self.entries.values())

    @property
    def write_bytes(self) -> int:
        """Bytes of the pretrained shards as written (what the progress of writing counts)."""
        return sum(self.written(f) for f in self.files)

    def written(self, file: Path) -> int:
        """Bytes the output's copy of ``file`` takes: the file itself, or its tensors once cast."""
        if not self.casts(file):
            return file.stat().st_size
        return sum(self._size(e) for e in self.entries.values() if e.file == file)

    def _size(self, entry: Entry) -> int:
        if self._casts(entry):
            return entry.nbytes // entry.torch_dtype.itemsize * self.cast.itemsize
        return entry.nbytes

    def _casts(self, entry: Entry) -> bool:
        return self.cast is not None and entry.torch_dtype.is_floating_point and entry.torch_dtype != self.cast

    def casts(self, file: Path) -> bool:
        return any(self._casts(e) for e in self.entries.values() if e.file == file)

    def weights(self, folder: Path | None = None) -> dict[str, tuple[Path, str]]:
        """The model's state-dict name -> (file, key) of every stored tensor: in the source, or in
        the written output ``folder`` (through its index)."""
        if folder is None:
            where = {key: entry.file for key, entry in self.entries.items()}
        else:
            where = {k: folder / f for k, f in json.loads((folder / INDEX_FILE).read_text())["weight_map"].items()}
        return {name: (where[key], key) for name, key in self.names.items() if key in where}


def plan_stream(folder: Path, recipe: Recipe, dtype: str = "auto") -> StreamPlan | str:
    """The plan for converting the model folder ``folder`` without loading it, or the reason it must
    be loaded (no safetensors weights, or tensors stored under names transformers remaps)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    files = weight_files(folder)
    if files is None:
        return "its weights are not safetensors files"
    config = load_config(str(folder), str(folder), local_files_only=True)
    target = resolve_dtype(dtype, config)
    entries: dict[str, Entry] = {}
    for file in files:
        try:
            found, _ = read_header(file)
        except DeltafyError as err:
            raise DeltafyError(f"could not load the weights of {folder}: {err}") from err
        twice = found.keys() & entries.keys()
        if twice:
            raise DeltafyError(f"{folder} stores tensor {min(twice)} twice (in two shards); its files are inconsistent")
        entries |= found
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=target, **NO_REMOTE_CODE)
    if getattr(model, "_keep_in_fp32_modules", None) and dtype != "auto":
        return "its family keeps some modules in float32, which a cast of the files would not"
    model.eval()
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    model.config._name_or_path = str(folder)
    convert(model, recipe)  # the heads are real: apply_deltafy keeps them off the meta device
    names = file_names(model, entries.keys(), str(folder))
    if isinstance(names, str):
        return names
    return StreamPlan(
        folder=folder,
        model=model,
        files=files,
        entries=entries,
        names=names,
        cast=target if dtype != "auto" else None,
        tokenizer=source_tokenizer(str(folder), str(folder), local_files_only=True),
        provenance=local_provenance(folder),
    )


def file_names(model: nn.Module, stored, what: str) -> dict[str, str] | str:
    """The key each of the model's tensors has in the source's files (the heads: the key they get),
    or the reason the files cannot be reused as they are. A checkpoint may store its tensors with or
    without the base model's prefix (GPT-2's ``h.0...`` for ``transformer.h.0...``); transformers
    adds the prefix on load either way, so the heads are named the way the files are."""
    state = model.state_dict(keep_vars=True)
    tied: dict[int, list[str]] = {}  # tied weights share one parameter: any one of their names will do
    for name, tensor in state.items():
        if isinstance(tensor, nn.Parameter):
            tied.setdefault(id(tensor), []).append(name)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    prefix = model.base_model_prefix + "."
    first: list[str] = []
    for strip in (False, True):
        names = {n: n.removeprefix(prefix) if strip else n for n in state}
        known = set(names.values())
        unknown = sorted(k for k in stored if k not in known and not any(p.search(k) for p in ignored))
        first = first or unknown
        if unknown:
            continue
        missing = [g[0] for g in tied.values() if not any(names[n] in stored or ".delta." in n for n in g)]
        if missing:
            raise DeltafyError(
                f"the weights of {what} are incomplete ({len(missing)} tensors missing, e.g. {missing[0]}); "
                f"the files may be truncated or from another model"
            )
        return names
    return f"it stores tensors under names transformers maps on load (e.g. {first[0]})"


def check_space(plan: StreamPlan, out: Path) -> None:
    """Refuse before any work when the output's filesystem cannot hold what will be copied."""
    parent = out.parent if out.parent.exists() else Path.cwd()
    device = os.stat(parent).st_dev
    need = sum(plan.written(f) for f in plan.files if plan.casts(f) or os.stat(f).st_dev != device)
    need += sum(t.numel() * t.element_size() for t in head_tensors(plan.model).values()) + (1 << 20)
    free = shutil.disk_usage(parent).free
    if need > free:
        raise DeltafyError(
            f"not enough disk space for {out}: it needs {size(need)} and {parent} has {size(free)} free; free "
            f"space or choose another --out"
        )


def write_tensors(plan: StreamPlan, folder: Path, progress: Progress = lambda nbytes: None) -> dict[str, int]:
    """The source's shards under the output's shard names, then a shard of heads, then the index
    (never a model.safetensors beside it: transformers would read that file alone). Returns how
    many shards were hard-linked, copied and cast."""
    count = len(plan.files) + 1
    shard = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    weight_map, how = {}, dict.fromkeys(("hard-linked", "copied", "cast"), 0)
    for file, name in zip(plan.files, shard, strict=False):
        keys = [e for e in plan.entries.values() if e.file == file]
        if plan.casts(file):
            _cast_file(plan, keys, folder / name, progress)
            how["cast"] += 1
        else:
            how["hard-linked" if _link_or_copy(file, folder / name, progress) else "copied"] += 1
        weight_map |= {e.key: name for e in keys}
    heads = {plan.names[name]: tensor for name, tensor in head_tensors(plan.model).items()}
    write_file(folder / shard[-1], [(k, t.dtype, tuple(t.shape)) for k, t in heads.items()], heads.__getitem__)
    weight_map |= dict.fromkeys(heads, shard[-1])
    total = plan.nbytes + sum(t.numel() * t.element_size() for t in heads.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return how


def _cast_file(plan: StreamPlan, entries: list[Entry], dest: Path, progress: Progress) -> None:
    def tensor(key: str) -> torch.Tensor:
        entry = plan.entries[key]
        with open(entry.file, "rb") as fh:
            value = read_tensor(fh, entry)
        if not plan._casts(entry):
            return value
        cast = value.to(plan.cast)
        check_cast(key, value, cast)
        return cast

    layout = [(e.key, plan.cast if plan._casts(e) else e.torch_dtype, e.shape) for e in entries]
    write_file(dest, layout, tensor, progress)


def check_cast(name: str, value: torch.Tensor, cast: torch.Tensor) -> None:
    """Refuse a cast that turned finite weights into inf (float16 holds at most ±65504): written, the
    model would compute NaN, and a self-check would only say that it is off by nan."""
    if torch.isfinite(cast).all() or not torch.isfinite(value).all():
        return
    peak = value.abs().max().item()
    dtype = str(cast.dtype).removeprefix("torch.")
    raise DeltafyError(
        f"{name} does not fit in {dtype}: its largest value is {peak:.4g}, beyond {torch.finfo(cast.dtype).max:.4g}; "
        f"convert with --dtype bfloat16 or float32"
    )


def _link_or_copy(src: Path, dest: Path, progress: Progress) -> bool:
    """A hard link (no bytes move; the shard is never modified in place, so sharing it is safe), or
    a copy in bounded chunks where the filesystem cannot link across. True for a link."""
    try:
        os.link(src, dest)
        progress(src.stat().st_size)
        return True
    except OSError as err:
        if err.errno not in LINK_FAILURES:
            raise
    buffer = memoryview(bytearray(CHUNK))
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while read := fin.readinto(buffer):
            fout.write(buffer[:read])
            progress(read)
    return False
